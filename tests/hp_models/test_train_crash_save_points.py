"""The trainer killed at each point of a save (tiny model, tp=2 on 2 ranks, 6 steps), in
the default checkpoint format (safetensors-shards at pp=1).

A rank is killed through the checkpoint's fault hook at each point of a save (staging made, files
written, before the manifest, before the rename, after it): the job stops, the checkpoint before
it is never lost, and every checkpoint left is, file for file, the uninterrupted run's of the same
step (never a mix); ``--resume`` picks the newest and the resumed loss curve equals the
uninterrupted run's bit for bit.  Resuming at another parallelism (tp=1 x dp_shard=2 from tp=2)
reshards model and AdamW state: the loss curve continues within float reassociation.  Trials are
counted in the output.  Kills from outside the job are ``test_train_crash_kills.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_crash_harness import STEPS, reference_run, resume, run, same_as_reference

from hp_checkpoint.manifest import complete_checkpoints

POINTS = [("staged", 1), ("files-written", 1), ("before-manifest", 0), ("before-commit", 0), ("after-commit", 0)]
# Crash trials whose resume also runs to the end (the others' checkpoints are compared file by
# file with the uninterrupted run's, which fixes their resumed runs too): at the same layout, and
# at tp=1 x dp_shard=2 (the state reshards).
RESUME_SAME = ("files-written", "after-commit")
RESUME_RESHARD = "before-commit"


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], Path]:
    return reference_run()


def test_kill_at_each_point_of_a_save(reference: tuple[list[float], Path], tmp_path: Path, capsys: Any) -> None:
    ref_losses, ref_root = reference
    trials = lost = resumed_runs = 0
    resumed_from: dict[str, int] = {}
    reshard_rel = -1.0
    for point, rank in POINTS:
        out = tmp_path / f"{point}-{rank}"
        crashed = run(out, STEPS, "--checkpoint-every", "2", fault=f"{point}@{rank}:4")
        assert crashed.returncode != 0, (point, crashed.stderr[-2000:])
        # the launcher names the rank that died and how, first (not a survivor's connection error)
        assert f"error: rank {rank} was killed by SIGKILL (signal 9)" in crashed.stderr, crashed.stderr[-2000:]
        found = complete_checkpoints(str(out / "checkpoint"))
        steps = [s for s, _ in found]
        newest, path = found[-1]
        assert newest == (4 if point == "after-commit" else 2), (point, steps)
        lost += 0 if 2 in steps else 1
        for _, p in found:
            same_as_reference(p, ref_root)
        if point in RESUME_SAME:
            assert resume(out, path, newest) == ref_losses  # same layout: bit for bit
            resumed_runs += 1
        elif point == RESUME_RESHARD:
            got = resume(out, path, newest, "--tp", "1", "--dp-shard", "2",
                          announced=("layout changed since the save: ", "dp_shard 1 -> 2", "tp 2 -> 1"))
            assert len(got) == STEPS and got[:newest] == ref_losses[:newest]
            reshard_rel = max(abs(a - b) / abs(b) for a, b in zip(got[newest:], ref_losses[newest:]))
            assert reshard_rel < 1e-5, (got, ref_losses)
            resumed_runs += 1
        resumed_from[point] = newest
        trials += 1
    with capsys.disabled():
        print(f"\ncrash at save points: {trials} trials, {lost} previous checkpoints lost, 0 mixes (every "
              f"checkpoint left equals the uninterrupted run's, file for file); newest complete: {resumed_from}; "
              f"{resumed_runs} resumed to the end: same layout bit for bit, tp=2 -> dp_shard=2 within "
              f"{reshard_rel:.1e} relative")
    assert trials == len(POINTS) and lost == 0
