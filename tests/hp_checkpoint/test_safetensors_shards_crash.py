# mypy: disable-error-code="no-untyped-def,arg-type,index,union-attr"
"""The safetensors-shards save under real ``kill -9`` (2 gloo ranks in a job launched here as
processes of their own, not the shared rank pool: forked from a server that imported torch once,
so a trial pays no interpreter start).  A rank is killed at each point of a save (the
``HP_CHECKPOINT_FAULT`` hook: staging made, its file written, before the manifest, before the
rename, after it, and once every rank was told) and at random moments from outside.  Afterwards the newest complete
checkpoint under the root is always the previous one or the new one, never a mix: every
complete checkpoint verifies and loads (in one process) bit-equal to what its step saved.  The
surviving rank does not hang: it fails in its next collective when the peer's socket closes
(bounded here by a timeout; a hang fails the test).  Trials are counted in the output."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from typing import Any

import pytest

from hp_dtensor.testing import preload_in_fork_server

SURVIVOR_TIMEOUT_S = 90
POINTS = [("staged", 1), ("files-written", 1), ("files-written", 0), ("before-manifest", 0),
          ("before-commit", 0), ("after-commit", 0), ("returning", 1)]
RANDOM_TRIALS = 4
RANDOM_STEPS = 200  # far more than fit before the kill: it always lands mid-job

# Each trial's ranks are fresh processes forked from one server that has only imported these (no
# rank state, no thread pool used), instead of interpreters that import torch per rank and trial.
_ctx = mp.get_context("forkserver")
preload_in_fork_server(["torch", "torch.distributed", "hp_dtensor", "hp_checkpoint.safetensors_shards",
                        "hp_checkpoint.manifest"])


def _state(step: int, rank: int, world: int) -> dict[str, Any]:
    """What step ``step`` saves: a sharded DTensor, a replicated one, a plain tensor, a JSON value."""
    import torch

    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    g = torch.Generator().manual_seed(1000 + step)
    full = {"w": torch.randn(301, 257, generator=g), "r": torch.randn(64, 33, generator=g)}
    if world == 1:
        return {"w": full["w"], "r": full["r"], "plain": torch.full((5,), float(step)), "meta": {"step": step}}
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "r": distribute_tensor(full["r"], mesh, [Replicate()]),
            "plain": torch.full((5,), float(step)), "meta": {"step": step}}


def _worker(rank: int, store: str, root: str, steps: int) -> None:
    """One rank of the job: save steps 1..steps, printing ``saved <n>`` after each."""
    import torch.distributed as dist

    from hp_checkpoint.safetensors_shards import save_shards

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    for step in range(1, steps + 1):
        save_shards(_state(step, rank, 2), root, step)
        print(f"saved {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


class _Rank:
    """One rank of a trial's job: its process, and its stdout and stderr in files."""

    def __init__(self, rank: int, store: str, root: str, steps: int, fault: str | None) -> None:
        folder = tempfile.mkdtemp(prefix=f"rank{rank}-")
        self.out_path, self.err_path = os.path.join(folder, "out"), os.path.join(folder, "err")
        for path in (self.out_path, self.err_path):  # there before the rank starts: polled from the start
            open(path, "w").close()
        self.proc = _ctx.Process(target=_rank_main, args=(rank, store, root, steps, fault, self.out_path, self.err_path))
        self.proc.start()

    def first_line(self, timeout: float) -> str:
        """The first line the rank prints (empty if it exits or the time runs out first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.out_path) as f:
                line = f.readline()
            if line.endswith("\n") or self.proc.exitcode is not None:
                return line
            time.sleep(0.02)
        return ""

    def stderr(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()


def _rank_main(rank: int, store: str, root: str, steps: int, fault: str | None, out_path: str, err_path: str) -> None:
    """A rank's process: its own environment (the fault spec only when the trial sets one), its
    stdout and stderr into files (a traceback lands in the stderr file, exit code 1)."""
    for name in ("RANK", "WORLD_SIZE", "HP_CHECKPOINT_FAULT"):
        os.environ.pop(name, None)
    if fault is not None:
        os.environ["HP_CHECKPOINT_FAULT"] = fault
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    _worker(rank, store, root, steps)


def _launch(root: str, steps: int, fault: str | None) -> list[_Rank]:
    store = os.path.join(tempfile.mkdtemp(), "store")
    return [_Rank(r, store, root, steps, fault) for r in range(2)]


def _finish(procs: list[_Rank]) -> tuple[list[int], list[str]]:
    """Wait for both ranks (each within the bound); a rank still running then is a hang."""
    codes, errs = [], []
    deadline = time.monotonic() + SURVIVOR_TIMEOUT_S
    for p in procs:
        p.proc.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.proc.exitcode is None:
            p.proc.kill()
            p.proc.join()
            codes.append(999)  # hung
        else:
            codes.append(p.proc.exitcode)
        errs.append(p.stderr())
    return codes, errs


def _check_root(root: str) -> tuple[int | None, int]:
    """Every complete checkpoint verifies and loads bit-equal to its step's state; returns the
    newest step (or None) and how many complete checkpoints were checked."""
    import torch

    from hp_checkpoint.manifest import complete_checkpoints, newest_complete, verify_checkpoint
    from hp_checkpoint.safetensors_shards import load_shards

    found = complete_checkpoints(root)
    for step, path in found:
        verify_checkpoint(path)
        want = _state(step, 0, 1)
        target = {"w": torch.zeros(301, 257), "r": torch.zeros(64, 33), "plain": torch.zeros(5), "meta": {"step": -1}}
        manifest = load_shards(target, path)
        assert manifest.step == step
        for k in ("w", "r", "plain"):
            assert torch.equal(target[k], want[k]), f"checkpoint {path}: tensor {k} is not step {step}'s: a mix"
        assert target["meta"] == {"step": step}, f"checkpoint {path}: meta {target['meta']} is not step {step}'s"
    newest = newest_complete(root)
    return (newest[0] if newest else None), len(found)


@pytest.mark.parametrize("point,rank", POINTS)
def test_kill_at_a_point_of_the_save_keeps_previous_or_new(point: str, rank: int) -> None:
    root = tempfile.mkdtemp()
    codes, errs = _finish(_launch(root, 2, f"{point}@{rank}:2"))
    assert codes[rank] == -signal.SIGKILL, (codes, errs[rank][-2000:])
    survivor = 1 - rank
    assert codes[survivor] not in (0, 999), f"survivor rank {survivor}: exit {codes[survivor]} (999 = hung)"
    newest, n = _check_root(root)
    # the new checkpoint exists exactly when the rename happened before the kill
    assert newest == (2 if point in ("after-commit", "returning") else 1), (point, rank, newest)
    print(f"kill -9 of rank {rank} at {point!r} of step 2's save: survivor exited {codes[survivor]}, "
          f"newest complete = step {newest} ({n} complete, all bit-equal to their step), mixes: 0")


def test_kill_at_random_moments_never_mixes() -> None:
    rng = random.Random(15)
    outcomes = []
    for trial in range(RANDOM_TRIALS):
        root = tempfile.mkdtemp()
        procs = _launch(root, RANDOM_STEPS, None)
        victim = trial % 2
        line = procs[victim].first_line(240)  # "saved 1": the job is up and has one checkpoint
        assert line.startswith("saved 1"), (line, procs[victim].stderr()[-2000:])
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(procs[victim].proc.pid, signal.SIGKILL)
        codes, errs = _finish(procs)
        survivor = 1 - victim
        assert codes[victim] == -signal.SIGKILL and codes[survivor] != 0, (trial, codes)  # killed mid-job
        assert codes[survivor] != 999, f"trial {trial}: survivor rank {survivor} hung"
        newest, n = _check_root(root)
        assert newest is not None and 1 <= newest < RANDOM_STEPS
        outcomes.append((victim, newest, n, codes[survivor]))
    print(f"{RANDOM_TRIALS} random kill -9 trials (victim, newest step, complete checkpoints, survivor exit): "
          f"{outcomes}; losses of the previous checkpoint: 0, mixes: 0, hangs: 0")

