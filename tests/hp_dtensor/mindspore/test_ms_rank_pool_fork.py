# mypy: disable-error-code="no-untyped-def"
"""MindSpore ranks of a ``RankPool`` fork from the test process's fork server, as torch ranks do
(MindSpore imported once, not per rank); a server that selected another platform than the pool's
before forking is refused at the pool's start, naming both, never a rank running the wrong backend."""

from __future__ import annotations

import os
import subprocess
import sys

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(2, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})


def _parents(rank: int, world_size: int) -> tuple[int, str]:
    from hp_dtensor.platform import current

    return os.getppid(), current().NAME


def test_mindspore_ranks_fork_from_the_server(ms_pool: RankPool) -> None:
    parents = ms_pool.run(_parents)
    assert [name for _, name in parents] == ["mindspore", "mindspore"]
    servers = {ppid for ppid, _ in parents}
    assert len(servers) == 1 and os.getpid() not in servers, (os.getpid(), parents)
    with open(f"/proc/{servers.pop()}/stat") as f:  # the server is this process's child
        assert int(f.read().rpartition(")")[2].split()[1]) == os.getpid()


_SELECTING_MAIN = """
from hp_dtensor.platform import current
from hp_dtensor.testing import RankError, RankPool

current()  # at import: the fork server imports this module ("__main__") and selects MindSpore


def _noop(rank, world_size):
    return rank


if __name__ == "__main__":
    try:
        with RankPool(1, env={"HYPER_PARALLEL_PLATFORM": "torch"}, start_timeout=120) as pool:
            pool.run(_noop)
    except RankError as e:
        print("REFUSED", e)
"""


def test_a_server_that_selected_another_platform_is_refused(tmp_path) -> None:
    script = tmp_path / "selecting_main.py"
    script.write_text(_SELECTING_MAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "HYPER_PARALLEL_PLATFORM": "mindspore"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout, done.stdout[-2000:]
    assert "this torch rank was forked from a fork server that selected mindspore" in done.stdout, done.stdout[-2000:]
