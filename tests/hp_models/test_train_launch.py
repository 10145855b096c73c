# mypy: disable-error-code="no-untyped-def"
"""The trainer's launcher with stand-in ranks (no model, so each case takes about a second).

- A rank killed with SIGKILL is named first, with its signal, before the error its survivor then
  hits (a connection reset by the dead peer), which used to be the only one reported.
- Whatever ends the launcher (a rank's death, SIGTERM) it removes its ``hp-train-<pid>-*``
  folder; folders of launchers that are gone (killed with SIGKILL) are removed by the next one,
  those of live launchers never.
- Ranks forked from the launcher's fork server die when the launcher is killed with SIGKILL (the
  server exits, the kernel kills its children) and start with the launcher's current environment.
  The SIGTERM case spawns its ranks, so both ways of starting them are covered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from hp_models import launch as launcher


def _pid_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.pid")


def _write_pid(folder: str, rank: int) -> None:
    """This process's pid in its rank's file, whole or not at all: a peer polling for the file
    must never read it half written (open() creates it before the write lands)."""
    tmp = _pid_file(folder, rank) + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, _pid_file(folder, rank))


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return True


def _killed_rank_and_survivor(rank: int, world: int, folder: str, store: str, results: Any, launcher: int) -> None:
    """Rank 0 is killed; rank 1 waits until it is dead, then reports what a gloo peer reports."""
    _write_pid(folder, rank)
    if rank == 0:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(_pid_file(folder, 0)):
        time.sleep(0.01)
    pid0 = int(open(_pid_file(folder, 0)).read())
    while not _zombie_or_gone(pid0):
        time.sleep(0.01)
    results.put((rank, False, ("traceback", "Traceback (most recent call last):\n  ...\n"
                                            "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Read error "
                                            "[127.0.0.1]:29500: Connection reset by peer\n")))


def _sleeper(rank: int, world: int, folder: str, store: str, results: Any, launcher: int) -> None:
    _write_pid(folder, rank)
    time.sleep(120)


def _wait_for_ranks(folder: str, proc: Any, limit_s: float, ranks: tuple[int, ...] = (0, 1)) -> list[int]:
    """The pids of ``ranks`` of launcher ``proc``, once all wrote them."""
    end = time.monotonic() + limit_s
    while not all(os.path.exists(_pid_file(folder, r)) for r in ranks):
        assert time.monotonic() < end and proc.poll() is None, "the ranks did not start"
        time.sleep(0.05)
    return [int(open(_pid_file(folder, r)).read()) for r in ranks]


def _wait_until_gone(ranks: list[int], what: str) -> None:
    end = time.monotonic() + 10
    while not all(_zombie_or_gone(p) for p in ranks):
        assert time.monotonic() < end, f"the ranks outlived the launcher {what}"
        time.sleep(0.05)


def _launcher_folders(tmp: str) -> list[str]:
    """The launchers' folders in ``tmp`` (``multiprocessing`` keeps its fork server's socket in a
    ``pymp-*`` folder of its own, removed when the process that started the server exits)."""
    return [n for n in os.listdir(tmp) if n.startswith("hp-train-")]


@pytest.fixture
def tmpdir_env(tmp_path: Any, monkeypatch: Any) -> str:
    tmp = str(tmp_path / "tmp")
    os.makedirs(tmp)
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    return tmp


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_killed_rank_is_named_first_with_its_signal(tmp_path: Any, tmpdir_env: str) -> None:
    with pytest.raises(launcher.JobFailed) as info:
        launcher.launch(2, _killed_rank_and_survivor, (str(tmp_path),), preload=())
    msg = str(info.value)
    assert msg.startswith("rank 0 was killed by SIGKILL (signal 9); then rank 1 failed: RuntimeError: "), msg
    assert msg.count("\n") == 0 and "Connection reset by peer" in msg, msg
    assert _launcher_folders(tmpdir_env) == []  # the launcher's folder is gone


_SIGTERM_LAUNCHER = """
import sys, tempfile
sys.path[:0] = {paths!r}
tempfile.tempdir = {tmp!r}
from hp_models import launch as launcher
import test_train_launch as t
launcher.launch(2, t._sleeper, ({folder!r},))
"""


def _armed_sleeper(rank: int, world: int, folder: str, store: str, results: Any, launcher_pid: int) -> None:
    """A rank as the trainer's (or, as rank 2, a process beside them as MindSpore's scheduler):
    dies with its launcher, then reports its parent and environment."""
    launcher.die_with_parent(launcher_pid)
    with open(os.path.join(folder, f"rank{rank}.facts.tmp"), "w") as f:
        f.write(f"{os.getppid()} {os.environ.get('HP_LAUNCH_PROBE')}")
    os.replace(os.path.join(folder, f"rank{rank}.facts.tmp"), os.path.join(folder, f"rank{rank}.facts"))
    _write_pid(folder, rank)
    time.sleep(120)


_SIGKILL_LAUNCHER = """
import multiprocessing.forkserver, os, sys, tempfile
sys.path[:0] = {paths!r}
tempfile.tempdir = {tmp!r}
from hp_models import launch as launcher
import test_train_launch as t
os.environ["HP_LAUNCH_PROBE"] = "first"
multiprocessing.forkserver.ensure_running()
os.environ["HP_LAUNCH_PROBE"] = "second"
# forked from the server started above: a process beside the ranks, then the ranks
launcher.start_beside(t._armed_sleeper, (2, 2, {folder!r}, "", None, os.getpid()), preload=())
launcher.launch(2, t._armed_sleeper, ({folder!r},), preload=())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_launcher_kills_its_forked_ranks(tmp_path: Any, tmpdir_env: str) -> None:
    """Ranks forked from the launcher's fork server (not its children) still die with it, and so
    does a process started beside them (``start_beside``): the server exits when the launcher is
    gone, and the kernel then kills its children.  They see the launcher's environment as it is
    when they start, not as it was when the server started."""
    folder = str(tmp_path)
    code = _SIGKILL_LAUNCHER.format(paths=[os.path.dirname(__file__), *sys.path], tmp=tmpdir_env, folder=folder)
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        ranks = _wait_for_ranks(folder, proc, 90, (0, 1, 2))
        facts = [open(os.path.join(folder, f"rank{r}.facts")).read().split() for r in (0, 1, 2)]
        assert all(parent != str(proc.pid) for parent, _ in facts), (facts, proc.pid)  # forked by the server
        assert [probe for _, probe in facts] == ["second"] * 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_until_gone(ranks, "killed with SIGKILL")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_the_ranks_and_removes_the_folder(tmp_path: Any, tmpdir_env: str) -> None:
    folder = str(tmp_path)
    code = _SIGTERM_LAUNCHER.format(paths=[os.path.dirname(__file__), *sys.path], tmp=tmpdir_env, folder=folder)
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        ranks = _wait_for_ranks(folder, proc, 60)
        assert [n for n in os.listdir(tmpdir_env) if n.startswith(f"hp-train-{proc.pid}-")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _launcher_folders(tmpdir_env) == []
    _wait_until_gone(ranks, "stopped with SIGTERM")


@pytest.mark.parametrize("preload", [None, ()], ids=["spawned", "forked"])
def test_arguments_that_cannot_be_pickled_raise_their_own_error(tmpdir_env: str, preload: Any) -> None:
    """A rank that fails to start (its arguments cannot be sent) raises the pickling error itself,
    not an error of the cleanup of ranks that never started; the folder is removed."""
    with pytest.raises(Exception, match="(?i)pickle") as info:
        launcher.launch(2, _sleeper, (lambda: None,), preload=preload)
    assert "NoneType" not in str(info.value), info.value
    assert _launcher_folders(tmpdir_env) == []


def test_stale_folders_of_dead_launchers_are_removed(tmpdir_env: str) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    names = [f"hp-train-{gone.pid}-abc", f"hp-train-{os.getpid()}-def", "hp-train-xyz", "other-1-x"]
    for name in names:
        os.makedirs(os.path.join(tmpdir_env, name))
    removed = launcher.remove_stale_temp_dirs()
    assert removed == [os.path.join(tmpdir_env, names[0])]
    assert sorted(os.listdir(tmpdir_env)) == sorted(names[1:])


def _reports(rank: int, world: int, store: str, results: Any, launcher_pid: int) -> None:
    results.put((rank, True, f"rank {rank} of {world}"))


_SCRIPT = """
import sys, tempfile
sys.path[:0] = {paths!r}
tempfile.tempdir = {tmp!r}
from hp_models import launch as launcher
import test_train_launch as t

{call}
"""
_CALLS = {
    "top_level": "print(launcher.launch(2, t._reports, ()))",
    "top_level_beside": "launcher.start_beside(t._reports, (0, 1, '', None, 0))",
    "guarded": "def run():\n    print(launcher.launch(2, t._reports, ()))\n\n\nif '__main__' == __name__:\n    run()",
    "guarded_forked": "if __name__ == '__main__' and True:\n    print(launcher.launch(2, t._reports, (), preload=()))",
}


@pytest.mark.parametrize("call", list(_CALLS))
def test_a_script_must_guard_the_ranks_it_starts(tmp_path: Any, tmpdir_env: str, call: str) -> None:
    """A script that starts ranks from its top level, outside ``if __name__ == "__main__":``, gets
    one error naming its file and line, before any rank starts (each rank imports the script again
    and would start the job anew); guarded, however the condition is written, the job runs."""
    script = tmp_path / f"{call}.py"
    script.write_text(_SCRIPT.format(paths=[os.path.dirname(__file__), *sys.path], tmp=tmpdir_env, call=_CALLS[call]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    if call.startswith("guarded"):
        assert done.returncode == 0 and done.stdout.strip() == "rank 0 of 2", (done.stdout, done.stderr[-2000:])
        return
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    line = _SCRIPT.splitlines().index("{call}") + 1
    assert last.startswith(f"hp_models.launch.JobFailed: {script}, line {line} starts the ranks from the script's top"), last
    assert "put the call under 'if __name__ == \"__main__\":'" in last and "bootstrapping" not in done.stderr, last
    assert _launcher_folders(tmpdir_env) == []
