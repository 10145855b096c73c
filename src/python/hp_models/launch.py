"""The trainer's launcher: start the ranks, supervise them, clean up; ranks die with it.

On Linux the ranks are forked from ``multiprocessing``'s fork server, which imports the modules
the caller names once: a spawned rank spent about 2.5 s of CPU importing torch and the trainer,
paid again by every rank of every run.  Elsewhere they are spawned.

A launcher killed with SIGKILL runs no cleanup, so its ranks would go on training (and writing
checkpoints) with nobody to report to.  On Linux the kernel delivers SIGKILL to a rank when its
parent dies (``PR_SET_PDEATHSIG``): the parent is the launcher's fork server, which exits as soon
as the launcher is gone (its end of the server's pipe closes; ``hp_dtensor.fork_server``,
shared with the test harness's rank pools).  Elsewhere a daemon thread polls the parent's pid.
The launcher's temporary folder (``hp-train-<pid>-*``) is removed by the next
launcher, which checks that pid.

When a rank dies the launcher names it, and its signal, before the errors the survivors then hit.
No framework is imported here.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hp_dtensor.fork_server import add_preload, let_go_of_the_fork_server
from hp_dtensor.fork_server import (
    die_with_parent as die_with_parent,  # re-exported: a rank's first call
)


class JobFailed(RuntimeError):
    """The job stopped (a rank died or raised) or could not start.  Its message is what the
    command prints."""


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def _last_line(report: tuple[str, str]) -> str:
    kind, text = report
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else kind
    return last if len(last) <= 300 else last[:297] + "..."


def supervise(procs: list[Any], results: Any, *, grace_s: float = 1.0) -> Any:
    """Wait for the ranks ``procs`` (rank order), each of which puts ``(rank, ok, value)`` on
    ``results`` (``value``: a result, or ``("user", line)`` / ``("traceback", text)``); returns rank
    0's value.  Raises ``JobFailed`` when a rank dies or fails.  A rank that died (a signal, an exit
    without a report) is named first with how it ended: the errors the survivors then hit (a
    connection reset by the dead peer) are its consequence, shown after it in one line."""
    import queue

    world = len(procs)
    out: Any = None
    done: set[int] = set()
    exited_at: dict[int, float] = {}
    dead: list[int] = []  # ranks that ended without reporting, in the order seen

    def look_for_dead() -> None:
        for r, p in enumerate(procs):
            code = p.exitcode
            if r in done or r in dead or code is None:
                continue
            # a rank that exits cleanly has put its result first: give the queue a moment
            first = exited_at.setdefault(r, time.monotonic())
            if code != 0 or time.monotonic() - first > 5.0:
                dead.append(r)

    def deaths() -> str:
        return "; ".join(f"rank {r} {_how_it_ended(procs[r].exitcode)}" for r in dead)

    failure: tuple[int, Any] | None = None
    while len(done) < world and failure is None and not dead:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            look_for_dead()
            continue
        done.add(rank)
        if not ok:
            failure = (rank, value)
        elif rank == 0:
            out = value
    if failure is None and not dead:
        return out
    # A death makes the survivors fail (a connection reset by the dead peer) and a survivor's
    # report can arrive before the death is seen: wait a moment for the other half of the story.
    end = time.monotonic() + grace_s
    while time.monotonic() < end and (failure is None or not dead):
        look_for_dead()
        if failure is not None:
            time.sleep(0.05)
            continue
        try:
            rank, ok, value = results.get(timeout=0.05)
        except queue.Empty:
            continue
        done.add(rank)
        if not ok:
            failure = (rank, value)
    if dead:
        then = f"; then rank {failure[0]} failed: {_last_line(failure[1])}" if failure is not None else ""
        raise JobFailed(f"{deaths()}{then}; the other ranks were stopped")
    assert failure is not None
    rank, (kind, text) = failure
    if kind == "user":
        raise JobFailed(text)
    raise JobFailed(f"rank {rank} failed:\n{text}")


_TEMP_PREFIX = "hp-train-"


def remove_stale_temp_dirs(tmp: str | None = None) -> list[str]:
    """Remove the temporary folders of launchers that are gone (killed with SIGKILL, which runs no
    cleanup): ``hp-train-<pid>-*`` of this user whose ``pid`` is not alive.  A folder of a live
    launcher is never touched; a reused pid only keeps a stale folder a little longer."""
    tmp = tmp if tmp is not None else tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return []
    for name in names:
        m = re.match(rf"^{_TEMP_PREFIX}(\d+)-", name)
        path = os.path.join(tmp, name)
        if m is None or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or another user's process of that pid): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _guards_main(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"`` (either way round, or as
    part of a larger condition)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Name) and p.id == "__name__" for p in parts) and any(
                    isinstance(p, ast.Constant) and p.value == "__main__" for p in parts):
                return True
    return False


def check_main_guard() -> None:
    """``JobFailed`` when the script this process runs starts ranks from its top level outside an
    ``if __name__ == "__main__":`` block.  Every rank, spawned or forked from the fork server,
    imports that script again before it runs, so each would start the job anew: ``multiprocessing``
    stops them with its "bootstrapping phase" error, and the launcher saw only ranks exiting with
    code 1.  A call from a function the guarded block calls, or with no script (``python -c``, a
    notebook, a test runner), passes."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return  # the source cannot be read: nothing to say
    for node in tree.body:
        if isinstance(node, ast.If) and _guards_main(node.test) and node.lineno <= line <= (node.end_lineno or line):
            return
    raise JobFailed(
        f"{path}, line {line} starts the ranks from the script's top level: each rank imports the script "
        f"again and would start the job anew; put the call under 'if __name__ == \"__main__\":'"
    )


def _rank_context(preload: Sequence[str] | None) -> Any:
    """Forked from the fork server where the caller allows it (``preload`` given) and a rank can
    die with the server (Linux); spawned otherwise.  First, the script must guard its call."""
    check_main_guard()
    if preload is None or not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    let_go_of_the_fork_server()  # a launcher forked from another's server starts one of its own
    add_preload(preload)
    return mp.get_context("forkserver")


def _rank_entry(target: Any, env: dict[str, str], *args: Any) -> None:
    """A rank starts with the launcher's environment as it is now: a forked rank's server may
    have been started earlier, with another (``multiprocessing`` passes the import path itself)."""
    let_go_of_the_fork_server()
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def start_beside(target: Any, args: tuple[Any, ...], *, preload: Sequence[str] | None = None) -> Any:
    """Start one process that serves the ranks (MindSpore's scheduler) the way ``launch`` starts a
    rank: forked from the same server where ``preload`` is given (on Linux), else spawned, with the
    launcher's environment as it is now.  ``target(*args)`` calls ``die_with_parent`` first; the
    caller stops and joins the process."""
    proc = _rank_context(preload).Process(target=_rank_entry, args=(target, dict(os.environ), *args), daemon=True)
    proc.start()
    return proc


def launch(world: int, target: Any, args: tuple[Any, ...], *, preload: Sequence[str] | None = None) -> Any:
    """Start ``world`` ranks running ``target(rank, world, *args, store, results, launcher_pid)``,
    supervise them (``supervise``) and return rank 0's result.  ``preload``: the modules every
    rank imports, imported once by the fork server the ranks are then forked from (on Linux);
    ``None`` spawns each rank afresh.  A preloaded module must not select the platform when
    imported: the server's choice would be every forked rank's.  ``target`` calls
    ``die_with_parent`` first.  Whatever ends the launcher
    (success, a rank's failure or death, Ctrl-C, SIGTERM), the ranks are stopped and its temporary
    folder (``hp-train-<pid>-*``, the rendezvous store) is removed; folders of launchers killed
    earlier are removed at start."""
    remove_stale_temp_dirs()
    ctx = _rank_context(preload)
    folder = tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-")
    results = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_entry,
                    args=(target, env, r, world, *args, os.path.join(folder, "store"), results, os.getpid()))
        for r in range(world)
    ]
    previous = None
    if threading.current_thread() is threading.main_thread():
        def stop(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, stop)
    finished = False
    try:
        for p in procs:
            p.start()
        out = supervise(procs, results)
        finished = True
        return out
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None and not finished:  # started and running
                p.kill()
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
