# mypy: disable-error-code="no-untyped-def,arg-type,index,union-attr"
"""The safetensors-shards save under real ``kill -9`` (2 gloo ranks in a job launched here as
subprocesses, not the shared rank pool).  A rank is killed at each point of a save (the
``HP_CHECKPOINT_FAULT`` hook: staging made, its file written, before the manifest, before the
rename, after it, and once every rank was told) and at random moments from outside.  Afterwards the newest complete
checkpoint under the root is always the previous one or the new one, never a mix: every
complete checkpoint verifies and loads (in one process) bit-equal to what its step saved.  The
surviving rank does not hang: it fails in its next collective when the peer's socket closes
(bounded here by a timeout; a hang fails the test).  Trials are counted in the output."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

SURVIVOR_TIMEOUT_S = 90
POINTS = [("staged", 1), ("files-written", 1), ("files-written", 0), ("before-manifest", 0),
          ("before-commit", 0), ("after-commit", 0), ("returning", 1)]
RANDOM_TRIALS = 4
RANDOM_STEPS = 200  # far more than fit before the kill: it always lands mid-job


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


def _launch(root: str, steps: int, fault: str | None) -> list[subprocess.Popen[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HP_CHECKPOINT_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if fault is not None:
        env["HP_CHECKPOINT_FAULT"] = fault
    store = os.path.join(tempfile.mkdtemp(), "store")
    return [subprocess.Popen([sys.executable, __file__, str(r), store, root, str(steps)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]


def _finish(procs: list[subprocess.Popen[str]]) -> tuple[list[int], list[str]]:
    """Wait for both ranks (each within the bound); a rank still running then is a hang."""
    codes, errs = [], []
    deadline = time.monotonic() + SURVIVOR_TIMEOUT_S
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            codes.append(999)  # hung
        errs.append(err)
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
        line = procs[victim].stdout.readline()  # "saved 1": the job is up and has one checkpoint
        assert line.startswith("saved 1"), (line, procs[victim].stderr.read()[-2000:] if procs[victim].poll() else "")
        time.sleep(rng.uniform(0.0, 0.5))
        procs[victim].send_signal(signal.SIGKILL)
        codes, errs = _finish(procs)
        survivor = 1 - victim
        assert codes[victim] == -signal.SIGKILL and codes[survivor] != 0, (trial, codes)  # killed mid-job
        assert codes[survivor] != 999, f"trial {trial}: survivor rank {survivor} hung"
        newest, n = _check_root(root)
        assert newest is not None and 1 <= newest < RANDOM_STEPS
        outcomes.append((victim, newest, n, codes[survivor]))
    print(f"{RANDOM_TRIALS} random kill -9 trials (victim, newest step, complete checkpoints, survivor exit): "
          f"{outcomes}; losses of the previous checkpoint: 0, mixes: 0, hangs: 0")


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
