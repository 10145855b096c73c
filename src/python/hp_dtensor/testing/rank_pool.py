"""``RankPool``: N real ranks started once, running many test functions.

Each rank is a process of its own with its own default process group, forked from a server
process that imported the framework and the backend once (``multiprocessing``'s forkserver): a
spawned rank spent about 1.8 s of CPU importing torch, or MindSpore, paid again by every pool a test
run starts.  Torch ranks rendezvous (gloo on CPU) on a ``FileStore`` in a fresh temporary folder, so
no port is chosen and parallel test files never collide.  For MindSpore the pool also starts the
scheduler process MindSpore's launcher would (``MS_ROLE=MS_SCHED``) on a port the OS hands out,
and gives each rank the ``MS_*`` variables ``msrun`` would set.
``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns
the list of results by rank.  An exception on any rank raises ``RankError`` with that rank's
traceback; a case that outlives its timeout raises ``RankTimeout`` naming the ranks that did not
finish, and the pool is restarted so later cases still run.  ``fn`` must be importable (a
module-level function) because ranks are other processes: a function or arguments that cannot be
pickled raise ``TypeError`` before anything is sent, and a result that cannot be pickled back (a tensor
that requires grad, a lambda) raises ``RankError`` naming it, not a timeout.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from hp_dtensor.fork_server import add_preload, die_with_parent, let_go_of_the_fork_server

_forkserver = mp.get_context("forkserver")
# What a torch rank imports before its first case, imported once by the fork server ("__main__":
# functions of the script that started the pool, found as a spawned rank finds them).  torch
# imports the last two lazily, about 1.1 s of CPU, the first time a tensor subclass (a DTensor)
# becomes a Parameter and an optimizer is built: in nearly every rank that trains.
_POOL_PRELOAD = ["__main__", "hp_dtensor.testing.rank_pool", "hp_dtensor.platform.torch",
                 "torch.distributed.tensor", "torch._dynamo"]
# A MindSpore rank's (and its scheduler's), preloaded where a MindSpore pool starts or MindSpore is
# the test process's platform: MindSpore's tests run torch pools too (their references), and the
# server imports whatever any of its ranks will need.  (The server skips a module that is not
# installed.)
_MINDSPORE_PRELOAD = ["hp_dtensor.platform.mindspore"]


def preload_in_fork_server(modules: list[str]) -> None:
    """Add ``modules``, and what a pool's ranks import, to what this process's fork server imports
    when it starts.  The server is shared by every forkserver process of the test process (pool
    ranks, the crash tests' launchers, the trainer's ranks): each adds to the one list."""
    mindspore = _MINDSPORE_PRELOAD if os.environ.get("HYPER_PARALLEL_PLATFORM") == "mindspore" else []
    add_preload([*_POOL_PRELOAD, *mindspore, *modules])


def _context(platform: str) -> Any:
    """Ranks of ``platform`` fork from the server.  The server has only imported modules: torch and
    MindSpore each leave one idle native thread behind, which a forked child does without; each
    framework's runtime and communication start in the rank (``init_rank``), after the fork."""
    preload_in_fork_server(_MINDSPORE_PRELOAD if platform == "mindspore" else [])  # (until the server starts)
    return _forkserver


_GRACE_S = 3.0  # after one rank fails, how long the others get to finish before a restart


class RankError(AssertionError):
    """A test function raised on one or more ranks."""


class RankTimeout(AssertionError):
    """A test function did not finish on every rank in time."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ms_scheduler_main(env: dict[str, str], starter: int) -> None:
    let_go_of_the_fork_server()
    die_with_parent(starter)
    os.environ.clear()  # (as a rank: the server's environment may be older than the pool's)
    os.environ.update(env)
    from hp_dtensor.platform import current

    current().serve_scheduler()


def _rank_main(
    rank: int, world_size: int, backend: str | None, store_path: str, tasks: Any, results: Any, env: dict[str, str],
    threads: int | None, starter: int,
) -> None:
    # A rank forked from the server is the server's child: it closes its copy of the server's
    # keep-alive pipe, so that a test process killed with SIGKILL takes the server, and with it
    # every rank, down (``fork_server``); a rank would otherwise wait for cases forever.
    let_go_of_the_fork_server()
    die_with_parent(starter)
    # The test process's environment as it is now, whether this rank was spawned from it or forked
    # from a server started earlier (``multiprocessing`` installs the caller's ``sys.path`` itself).
    os.environ.clear()
    os.environ.update(env)
    from hp_dtensor.platform import current, platform_name

    plat = current()
    if threads is not None:
        plat.set_num_threads(threads)
    try:
        if plat.NAME != platform_name():
            # The server imported a module that selected its own platform, for good: module-level
            # names bound then would stay that framework's in every rank forked from it.
            raise RuntimeError(
                f"this {platform_name()} rank was forked from a fork server that selected {plat.NAME}; "
                f"preload only modules that do not select a platform (preload_in_fork_server)")
        plat.init_rank(backend, store_path, rank, world_size, timeout_s=300)
    except BaseException:
        results.put((-1, rank, False, traceback.format_exc()))
        return
    results.put((-1, rank, True, _encode(None)))
    while True:
        item = tasks.get()
        if item is None:
            break
        case_id, task = item
        try:
            fn, args, kwargs = pickle.loads(task)
            value = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            results.put((case_id, rank, False, traceback.format_exc()))
            continue
        try:
            blob = _encode(value)
        except Exception as e:
            results.put((case_id, rank, False, f"{getattr(fn, '__qualname__', fn)} returned a {type(value).__name__} "
                         f"that cannot be sent back to the test process ({type(e).__name__}: {e}); return "
                         f"picklable data: detach tensors that require grad, no lambdas or open handles"))
            continue
        results.put((case_id, rank, True, blob))
    plat.destroy()
    _exit_now(results)


def _encode(value: Any) -> bytes:
    """``value`` pickled now, where a failure can be reported as this case's error: a queue pickles
    in a background thread, which only prints the error and drops the item, so the case would end
    as a timeout instead."""
    return bytes(ForkingPickler.dumps(value))


def _exit_now(results: Any) -> None:
    """Leave without the interpreter's teardown: freeing the framework's modules one by one took
    about 0.9 s of each rank's exit (1.7 s of CPU for a 4-rank pool), paid by every test file that
    closes a pool.  What an exit must do still runs: the results are flushed to the pipe, exit
    handlers (``atexit``, ``weakref.finalize``: temporary folders) run, logs and streams flush."""
    results.close()
    results.join_thread()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


class RankPool:
    """``world_size`` rank processes; start on first ``run``; ``close`` (or ``with``) stops them."""

    def __init__(self, world_size: int, *, backend: str | None = None, timeout: float = 60.0,
                 start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 threads_per_rank: int | None = 1) -> None:
        """``threads_per_rank``: what each rank passes to the backend's ``set_num_threads`` before
        joining (ranks share the machine's cores); None keeps the framework's defaults (e.g.
        MindSpore's asynchronous op queue, for a benchmark that measures it)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if threads_per_rank is not None and threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be None or >= 1, got {threads_per_rank}")
        self.world_size = world_size
        self.threads_per_rank = threads_per_rank
        self.backend = backend
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **(env or {})}
        self._procs: list[Any] = []
        self._scheduler: Any = None
        self._tasks: list[Any] = []
        self._results: Any = None
        self._dir: str | None = None
        self._case = 0
        self.restarts = 0

    # ----- lifecycle -----
    @property
    def started(self) -> bool:
        """Whether the ranks are running (a pool starts on its first ``run``)."""
        return bool(self._procs)

    def start(self) -> None:
        if self._procs:
            return
        let_go_of_the_fork_server()  # a pool started in a forked process: its own server, not its parent's
        self._dir = tempfile.mkdtemp(prefix="hp-rankpool-")
        store = os.path.join(self._dir, "store")
        platform = self._platform()
        ctx = _context(platform)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        rank_env = self._launcher_env(platform, ctx)
        for rank in range(self.world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(rank, self.world_size, self.backend, store, self._tasks[rank], self._results,
                      {**os.environ, **self.env, **rank_env(rank)}, self.threads_per_rank, os.getpid()),
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        ready = self._collect(-1, self.start_timeout)
        failed = [r for r, (ok, _) in ready.items() if not ok]
        if failed or len(ready) < self.world_size:
            detail = "\n".join(f"--- rank {r} ---\n{ready[r][1]}" for r in failed)
            missing = sorted(set(range(self.world_size)) - set(ready))
            self.close(force=True)
            raise RankError(f"rank pool failed to start (ranks not up: {missing})\n{detail}")

    def _platform(self) -> str:
        from hp_dtensor.platform import platform_name

        return self.env.get("HYPER_PARALLEL_PLATFORM") or platform_name()

    def _launcher_env(self, name: str, ctx: Any) -> Callable[[int], dict[str, str]]:
        """Per-rank launcher variables: none on torch; the scheduler's address on MindSpore."""
        if name != "mindspore":
            return lambda rank: {}
        common = {
            "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(_free_port()),
            "MS_WORKER_NUM": str(self.world_size), "GLOG_v": os.environ.get("GLOG_v", "3"),
            "HYPER_PARALLEL_PLATFORM": "mindspore",
        }
        self._scheduler = ctx.Process(
            target=_ms_scheduler_main, args=({**os.environ, **self.env, **common, "MS_ROLE": "MS_SCHED"}, os.getpid()),
            daemon=True)
        self._scheduler.start()
        return lambda rank: {**common, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank)}

    def close(self, force: bool = False) -> None:
        for i, p in enumerate(self._procs):
            if not force and p.is_alive():
                try:
                    self._tasks[i].put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (0 if force else 10)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self._scheduler is not None:
            # Every worker left the job cleanly: the scheduler has nobody left to serve, but it
            # lingers ~4.5 s on its own heartbeat before exiting, paid by every MindSpore pool.
            if self._procs and all(p.exitcode == 0 for p in self._procs):
                self._scheduler.terminate()
            self._scheduler.join(timeout=max(0.0, deadline - time.monotonic()) + 2)
            if self._scheduler.is_alive():
                self._scheduler.kill()
                self._scheduler.join(timeout=5)
            self._scheduler = None
        self._procs = []
        self._tasks = []
        self._results = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- running cases -----
    def _collect(self, case_id: int, timeout: float) -> dict[int, tuple[bool, Any]]:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            if any(not ok for ok, _ in got.values()):
                deadline = min(deadline, now + _GRACE_S)
            try:
                cid, rank, ok, value = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                for r in dead:
                    got[r] = (False, f"rank {r} process died (exit code {self._procs[r].exitcode})")
                continue
            if cid == case_id:
                got[rank] = (ok, value)
        return got

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results by rank."""
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            task = _encode((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"{name} and its arguments must be picklable to reach the ranks (a module-level function, "
                            f"plain arguments): {type(e).__name__}: {e}") from e
        self.start()
        self._case += 1
        case_id = self._case
        for q in self._tasks:
            q.put((case_id, task))
        limit = self.timeout if timeout is None else timeout
        got = self._collect(case_id, limit)
        failed = sorted(r for r, (ok, _) in got.items() if not ok)
        missing = sorted(set(range(self.world_size)) - set(got))
        dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
        if missing or dead:  # the next case gets whole, fresh ranks
            self.close(force=True)
            self.restarts += 1
        died = sorted(dead)
        if failed:
            # The summary names the cause: a rank that died explains every other rank's missing
            # result (a healthy rank on a loaded machine may also just miss the grace period), so
            # deaths come first; ranks cut off without a death are named when nothing died.
            sections = [f"--- rank {r} ---\n{got[r][1]}" for r in failed]
            sections += [
                f"--- rank {r} ---\n"
                + (f"rank {r} process died (exit code {dead[r]})" if r in dead else
                   f"no result when the pool stopped waiting, after ranks {failed} failed (waiting on them in a "
                   f"collective, or slow); stopped with the pool")
                for r in missing
            ]
            if died:
                extra = f" (ranks {died} died; pool restarted)"
            elif missing:
                extra = f" (ranks {missing} did not finish; pool restarted)"
            else:
                extra = ""
            raise RankError(f"{name} raised on ranks {failed}{extra}\n" + "\n".join(sections))
        if missing:
            also = f" (ranks {died} died)" if died else ""
            raise RankTimeout(
                f"{name} did not finish within {limit:.0f} s on ranks {missing}{also}; the pool was restarted"
            )
        try:
            return [pickle.loads(got[r][1]) for r in range(self.world_size)]
        except Exception as e:
            raise RankError(f"{name}: a rank's result cannot be read in the test process: {type(e).__name__}: {e}") from e


# Started pools that test modules hand on to each other, newest last.  Older ones are closed
# while the pools alive hold more than _KEEP_RANKS ranks: a rank that ran many modules holds 0.4
# to 0.8 GB, and two test batches run at once on a machine of 23 GB.
_shared: dict[tuple[Any, ...], RankPool] = {}
_KEEP_RANKS = 8


def _close_shared() -> None:
    while _shared:
        _shared.pop(next(iter(_shared))).close()


atexit.register(_close_shared)  # after multiprocessing's own handler is registered: runs first


def shared_pool(world_size: int, *, timeout: float = 60.0, env: dict[str, str] | None = None) -> RankPool:
    """A ``RankPool`` of ``world_size`` ranks with ``env`` that outlives the caller: the next caller
    asking for the same size and environment in this process gets the same (started) ranks, with
    its own per-case ``timeout``.  Starting ranks is the expensive part of a multi-rank test file
    (about 0.9 s of CPU per torch rank, 10 to 20 s of waiting for a MindSpore job to form), so the
    files a test runner batches into one process share them.  The newest pools stay alive while
    they hold at most ``_KEEP_RANKS`` ranks together (each rank holds a framework's memory); the
    rest, and all at exit, are closed."""
    key = (world_size, tuple(sorted((env or {}).items())))
    pool = _shared.pop(key, None)
    if pool is None:
        pool = RankPool(world_size, timeout=timeout, env=env)
    _shared[key] = pool  # newest last
    while len(_shared) > 1 and sum(p.world_size for p in _shared.values()) > _KEEP_RANKS:
        _shared.pop(next(iter(_shared))).close()
    pool.timeout = timeout
    return pool


def _in_step(rank: int, world_size: int) -> bool:
    from hp_dtensor.platform import current

    plat = current()
    if world_size > 1:
        plat.COLLECTIVES.barrier(plat.get_or_create_group(tuple(range(world_size))), world_size)
    return True


def _hand_on(pool: RankPool) -> None:
    """Before a module's shared ranks go to the next module: one barrier on all of them.  Ranks a
    failed case left out of step (one still inside a collective the others left) are closed here,
    so the failure stays with the module that caused it."""
    if not pool.started:
        return
    try:
        pool.run(_in_step, timeout=30)
    except (RankError, RankTimeout):
        for key, kept in list(_shared.items()):
            if kept is pool:
                del _shared[key]
        pool.close(force=True)


def rank_pool_fixture(world_size: int, *, timeout: float = 60.0, env: dict[str, str] | None = None,
                      fresh: bool = False) -> Any:
    """A module-scoped pytest fixture yielding a started ``RankPool``.  By default the ranks are
    ``shared_pool``'s, reused by later modules in the same process: a module's cases must leave
    the ranks as they found them (undo monkeypatches, keep the default process group).
    ``fresh=True``: ranks of the module's own, started for it and closed after it."""
    import pytest  # pants: no-infer-dep  (pytest is only needed by test suites using this fixture)

    @pytest.fixture(scope="module")
    def _pool() -> Iterator[RankPool]:
        if not fresh:
            pool = shared_pool(world_size, timeout=timeout, env=env)
            yield pool
            _hand_on(pool)
            return
        pool = RankPool(world_size, timeout=timeout, env=env)
        try:
            yield pool
        finally:
            pool.close()

    return _pool
