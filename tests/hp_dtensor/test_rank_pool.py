# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The multi-rank harness itself: results, failures, hangs, restarts, fake worlds."""

from __future__ import annotations

import os
import sys
import time

import pytest

from hp_dtensor.testing import RankError, RankPool, RankTimeout, fake_world, rank_pool_fixture, shared_pool
from hp_dtensor.testing import rank_pool as rank_pool_module

pool4 = rank_pool_fixture(4, fresh=True)  # counts its own restarts


def _all_reduce(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_2(rank: int, world_size: int) -> int:
    if rank == 2:
        raise ValueError("boom on rank two")
    return rank


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _echo(rank: int, world_size: int, value: int, *, scale: int = 1) -> tuple[int, int, int]:
    return rank, world_size, value * scale


def test_four_rank_all_reduce(pool4: RankPool) -> None:
    assert pool4.run(_all_reduce) == [10.0, 10.0, 10.0, 10.0]


def test_args_and_results_by_rank(pool4: RankPool) -> None:
    assert pool4.run(_echo, 7, scale=2) == [(r, 4, 14) for r in range(4)]


def test_rank_exception_carries_its_traceback(pool4: RankPool) -> None:
    with pytest.raises(RankError) as info:
        pool4.run(_raise_on_rank_2)
    msg = str(info.value)
    assert "ranks [2]" in msg and "boom on rank two" in msg and "Traceback" in msg
    # the pool is still usable: the other ranks finished the case
    assert pool4.run(_all_reduce) == [10.0] * 4


def test_hang_times_out_names_ranks_and_pool_recovers(pool4: RankPool) -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool4.run(_hang_on_rank_1, timeout=3)
    assert "ranks [1]" in str(info.value)
    assert time.monotonic() - start < 30
    restarts = pool4.restarts
    assert pool4.run(_all_reduce) == [10.0] * 4
    assert restarts == 1


def _unpicklable_on_rank_3(rank: int, world_size: int) -> object:
    import torch

    x = torch.ones(2, requires_grad=True)
    return x * 2 if rank == 3 else (x * 2).detach()


def _returns_lambda(rank: int, world_size: int) -> object:
    return lambda: rank


def test_result_that_cannot_be_pickled_is_an_error_not_a_timeout(pool4: RankPool) -> None:
    # a queue pickles in a background thread that drops what it cannot pickle: the case used to
    # end only at its timeout, as a RankTimeout that hid the cause
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool4.run(_unpicklable_on_rank_3, timeout=60)
    msg = str(info.value)
    assert "ranks [3]" in msg and "requires_grad" in msg and "detach" in msg
    with pytest.raises(RankError) as info:
        pool4.run(_returns_lambda, timeout=60)
    assert "ranks [0, 1, 2, 3]" in str(info.value) and "lambda" in str(info.value)
    assert time.monotonic() - start < 20
    restarts = pool4.restarts
    assert pool4.run(_all_reduce) == [10.0] * 4  # no restart was needed
    assert pool4.restarts == restarts


def test_function_or_argument_that_cannot_be_pickled_raises_at_once(pool4: RankPool) -> None:
    start = time.monotonic()
    with pytest.raises(TypeError, match="must be picklable"):
        pool4.run(lambda rank, world_size: rank, timeout=60)
    with pytest.raises(TypeError, match="must be picklable"):
        pool4.run(_echo, lambda: 1, timeout=60)
    assert time.monotonic() - start < 5
    assert pool4.run(_echo, 3) == [(r, 4, 3) for r in range(4)]


def test_one_and_two_rank_pools() -> None:
    with RankPool(1) as p1:
        assert p1.run(_all_reduce) == [1.0]
    with RankPool(2) as p2:
        assert p2.run(_all_reduce) == [3.0, 3.0]


def _threads(rank: int, world_size: int) -> int:
    import torch

    return torch.get_num_threads()


def test_threads_per_rank() -> None:
    """Ranks keep to one thread by default (they share the machine's cores); None leaves the
    framework's own default; anything below 1 is refused naming the value."""
    import torch

    with RankPool(2, threads_per_rank=None) as free:
        assert free.run(_threads) == [torch.get_num_threads()] * 2
    with RankPool(2, threads_per_rank=2) as two:
        assert two.run(_threads) == [2, 2]
    with pytest.raises(ValueError, match="threads_per_rank must be None or >= 1, got 0"):
        RankPool(2, threads_per_rank=0)


def _started_from(rank: int, world_size: int, name: str) -> tuple[str | None, str, int, int]:
    import sys

    import torch

    return os.environ.get(name), sys.path[0], os.getppid(), torch.get_num_threads()


def test_torch_ranks_fork_from_one_server_with_the_callers_env_and_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch ranks are forked from the process's one fork server (their parent is not the test
    process, and two pools share it), yet each pool's ranks see the test process's environment
    and import path as they are when the pool starts, as spawned ranks would, plus the pool's own
    ``env``; the thread count is still set per rank."""
    import sys

    monkeypatch.setenv("HP_RANK_POOL_PROBE", "first")
    monkeypatch.syspath_prepend("/hp-rank-pool-probe-a")
    with RankPool(2) as a:
        got_a = a.run(_started_from, "HP_RANK_POOL_PROBE")
    monkeypatch.setenv("HP_RANK_POOL_PROBE", "second")
    monkeypatch.syspath_prepend("/hp-rank-pool-probe-b")
    with RankPool(2, env={"HP_RANK_POOL_EXTRA": "x"}, threads_per_rank=2) as b:
        got_b = b.run(_started_from, "HP_RANK_POOL_PROBE")
        extra = b.run(_started_from, "HP_RANK_POOL_EXTRA")
    assert [g[:2] for g in got_a] == [("first", "/hp-rank-pool-probe-a")] * 2
    assert [g[:2] for g in got_b] == [("second", "/hp-rank-pool-probe-b")] * 2
    assert [g[0] for g in extra] == ["x", "x"] and [g[3] for g in got_b] == [2, 2]
    parents = {g[2] for g in got_a + got_b}
    assert len(parents) == 1 and os.getpid() not in parents, (parents, os.getpid())
    assert sys.path[0] == "/hp-rank-pool-probe-b"


@pytest.mark.parametrize("world", [8, 16])
def test_fake_world_builds_meshes_of_any_size(world: int) -> None:
    from hp_dtensor import init_device_mesh

    with fake_world(world, rank=world - 1):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        assert mesh.get_coordinate() == (1, world // 2 - 1)
        assert mesh["tp"].size() == world // 2
        assert mesh.group_ranks(1) == tuple(range(world // 2, world))


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def test_shared_pools_hand_the_same_ranks_to_the_next_module() -> None:
    first = shared_pool(2, timeout=30)
    pids = first.run(_pid)
    again = shared_pool(2, timeout=45)  # the next module: same ranks, its own case timeout
    assert again is first and again.timeout == 45 and again.run(_pid) == pids
    other = shared_pool(2, env={"HP_RANK_POOL_TEST": "1"})  # another environment: other ranks
    assert other is not first
    # beyond _KEEP_RANKS ranks alive the oldest pools are closed (their ranks stopped), not leaked
    for i in range(rank_pool_module._KEEP_RANKS // 2):
        shared_pool(2, env={"HP_RANK_POOL_TEST": f"spare-{i}"})  # never run: never started
    assert first._procs == [] and not any(pool is first for pool in rank_pool_module._shared.values())
    assert sum(pool.world_size for pool in rank_pool_module._shared.values()) <= rank_pool_module._KEEP_RANKS
    big = shared_pool(rank_pool_module._KEEP_RANKS + 1)  # one pool over the limit alone is still kept
    assert list(rank_pool_module._shared.values()) == [big]
    fresh = shared_pool(2, timeout=30)  # asked again: started anew, not the closed one
    assert fresh is not first and set(fresh.run(_pid)).isdisjoint(pids)


def _die_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # a crash: no exception, no result
    return rank


def test_a_rank_that_dies_fails_the_case_and_the_pool_restarts() -> None:
    pool = shared_pool(2, env={"HP_RANK_POOL_TEST": "dies"})
    first = pool.run(_pid)
    with pytest.raises(RankError, match=r"(?s)raised on ranks \[1\] \(ranks \[1\] died; pool restarted\).*exit code 3"):
        pool.run(_die_on_rank_1)
    again = pool.run(_pid)  # whole ranks again, not a pool with a dead member
    assert pool.restarts == 1 and set(again).isdisjoint(first)


def _die_on_rank_1_while_rank_0_is_slow(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    time.sleep(60)  # a healthy rank that misses the grace period (the pool's restart ends it)
    return rank


def test_a_death_is_named_even_when_a_healthy_rank_is_cut_off() -> None:
    # On a loaded machine a surviving rank may not report within the grace period; the summary
    # still names the rank that died, and the survivor gets its own section.
    pool = shared_pool(2, env={"HP_RANK_POOL_TEST": "dies-slow"})
    with pytest.raises(RankError, match=r"(?s)raised on ranks \[1\] \(ranks \[1\] died; pool restarted\)"
                       r".*exit code 3.*--- rank 0 ---\nno result when the pool stopped waiting, "
                       r"after ranks \[1\] failed"):
        pool.run(_die_on_rank_1_while_rank_0_is_slow)
    assert pool.restarts == 1


def test_shared_ranks_out_of_step_are_not_handed_on() -> None:
    import signal

    pool = shared_pool(2, env={"HP_RANK_POOL_TEST": "handed-on"})
    pids = pool.run(_pid)
    os.kill(pids[1], signal.SIGKILL)  # killed between modules (say, by the OOM killer)
    for _ in range(100):
        if not pool._procs[1].is_alive():
            break
        time.sleep(0.05)
    rank_pool_module._hand_on(pool)
    assert not pool.started and all(kept is not pool for kept in rank_pool_module._shared.values())


_PRELOAD_SCRIPT = """
import sys
from hp_dtensor.testing import RankPool, preload_in_fork_server


def _loaded(rank, world_size, modules):  # found by the rank through the preloaded "__main__"
    return [m in sys.modules for m in modules]


if __name__ == "__main__":
    {add}  # before any pool starts
    with RankPool(1) as pool:
        print(pool.run(_loaded, ["json.tool", "torch._dynamo", "torch.distributed.tensor"]))
"""


@pytest.mark.parametrize("add", [
    'preload_in_fork_server(["json.tool"])',  # as a crash test's module does
    'import multiprocessing; multiprocessing.set_forkserver_preload(["__main__", "json.tool"])',  # another library
], ids=["through_the_pool", "set_by_another_user"])
def test_preloads_add_up_in_the_one_fork_server(tmp_path, add: str) -> None:
    """Preloads that another user of the fork server set (the crash tests' launchers, the trainer's
    launcher) and the pool's add up: in a fresh process, a rank forked after both asked finds both
    already imported."""
    import subprocess
    import sys

    script = tmp_path / "preload_main.py"
    script.write_text(_PRELOAD_SCRIPT.replace("{add}", add))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[[True, True, True]]", done.stdout


_KILLED_SCRIPT = """
import multiprocessing.forkserver, os, time
from hp_dtensor.testing import RankPool


def _pid(rank, world_size):
    return os.getpid()


if __name__ == "__main__":
    pool = RankPool(2)
    ranks = pool.run(_pid)
    print(*ranks, multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
    time.sleep(300)  # killed with SIGKILL here: no cleanup runs
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_test_process_killed_with_sigkill(tmp_path) -> None:
    """A test process killed with SIGKILL (a timeout of the test runner, the OOM killer) runs no
    cleanup.  Its ranks, children of its fork server and blocked waiting for the next case, used
    to live on with the server; now the server exits with the test process and the kernel kills
    the ranks within seconds."""
    import signal
    import subprocess

    script = tmp_path / "killed_main.py"
    script.write_text(_KILLED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and not any(_gone(p) for p in pids), line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    end = time.monotonic() + 10
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < end, f"ranks {pids[:2]} or fork server {pids[2]} outlived the killed test process"
        time.sleep(0.05)


def _exit_code_of_child_that_dies_with(starter: int, *, proc_readable: bool) -> int:
    """Fork a child (whose parent is this process) that calls ``die_with_parent(starter)`` and
    then exits 0; its exit code (-9: it killed itself)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            from hp_dtensor import fork_server

            if not proc_readable:  # as without /proc (macOS): no grandparent known
                fork_server._parent_of = lambda _pid: None  # type: ignore[assignment]
            fork_server.die_with_parent(starter)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
@pytest.mark.parametrize("proc_readable", [True, False], ids=["with_proc", "without_proc"])
def test_a_rank_dies_only_when_its_starter_is_gone(proc_readable: bool) -> None:
    """A rank whose parent is the starter's child (the fork server) lives while the starter does,
    with or without /proc to read the grandparent from; it kills itself when the starter is gone."""
    import subprocess

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    assert _exit_code_of_child_that_dies_with(os.getppid(), proc_readable=proc_readable) == 0
    assert _exit_code_of_child_that_dies_with(os.getpid(), proc_readable=proc_readable) == 0
    assert _exit_code_of_child_that_dies_with(gone.pid, proc_readable=proc_readable) == -9
