"""The trainer under real ``kill -9`` from outside (tiny model, tp=2 on 2 ranks, 6 steps).
Its checkpoints are DCP here, the format of pipeline-parallel runs (the default format's kills
at each point of a save are ``test_train_crash_save_points.py``'s).

- Ranks killed at random moments of a run that checkpoints every step: the job stops, the
  checkpoint before it is never lost, and every checkpoint left is, file for file, the
  uninterrupted run's of the same step (never a mix); the first trial resumes to the end bit for
  bit.  Trials are counted in the output.
- Killing the launcher with SIGKILL stops every rank; ``--resume`` without a complete checkpoint
  is refused before any rank starts.

Kills at each point of a save (through the checkpoint's fault hook) are
``test_train_crash_save_points.py``'s.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from train_crash_harness import (
    DCP,
    STEPS,
    alive,
    rank_pids,
    reference_run,
    resume,
    run,
    same_as_reference,
    saving,
    start,
    wait_for,
)

from hp_checkpoint.manifest import complete_checkpoints

RANDOM_TRIALS = 4


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], Path]:
    return reference_run(DCP)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_a_rank_at_random_moments(reference: tuple[list[float], Path], tmp_path: Path, capsys: Any) -> None:
    """A checkpoint every step; once the first exists and the next save has begun, a random rank
    is killed after a random delay, from outside the job.  Whatever the moment, what is left is
    the uninterrupted run's."""
    ref_losses, ref_root = reference
    rng = random.Random(15)
    trials = lost = during_save = 0
    left: list[int] = []
    for t in range(RANDOM_TRIALS):
        out = tmp_path / f"random-{t}"
        proc = start(out, STEPS, "--checkpoint-every", "1", *DCP)
        root = out / "checkpoint"
        first = root / "step-00000001" / "manifest.json"
        assert wait_for(first.exists, 240), "no first checkpoint"
        # aim at a save: wait for a later one to start, then kill at a random moment of it or after
        assert wait_for(lambda r=root, p=proc: saving(r) or p.poll() is not None, 240)
        time.sleep(rng.uniform(0.0, 0.4))
        ranks = rank_pids(proc.pid)
        found = complete_checkpoints(str(root))
        if len(ranks) < 2 or proc.poll() is not None:
            proc.wait(timeout=120)
            continue
        before = found[-1][0]  # the newest complete checkpoint at the kill
        os.kill(rng.choice(ranks), signal.SIGKILL)
        proc.wait(timeout=120)
        if proc.returncode == 0:  # the kill landed after the last step: not a crash
            continue
        during_save += saving(root)
        found = complete_checkpoints(str(root))
        for _, p in found:
            same_as_reference(p, ref_root)
        newest, path = found[-1]
        lost += 0 if newest >= before else 1
        left.append(newest)
        if trials == 0:
            assert resume(out, path, newest, *DCP) == ref_losses
        trials += 1
        assert wait_for(lambda pids=ranks: not any(alive(p) for p in pids), 30)
    with capsys.disabled():
        print(f"\nrandom kills: {trials} trials ({during_save} inside a save), {lost} checkpoints lost, 0 mixes; "
              f"newest complete checkpoints left: steps {left}; the first resumed to the end bit for bit")
    assert trials >= RANDOM_TRIALS - 1 and lost == 0


def test_killing_the_launcher_stops_the_ranks(tmp_path: Path) -> None:
    out = tmp_path / "orphans"
    proc = start(out, 500, "--checkpoint-every", "1", "--keep", "1")
    try:
        # the ranks are training (a rank still importing when its launcher dies exits as soon as
        # its worker starts: it finds its parent gone)
        first = out / "checkpoint" / "step-00000001" / "manifest.json"
        assert wait_for(first.exists, 240), "the ranks did not start training"
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2 and all(alive(p) for p in ranks), ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_for(lambda: not any(alive(p) for p in ranks), 10.0), [p for p in ranks if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_resume_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoint" / ".staging-step-00000002-abc").mkdir(parents=True)  # a crashed save only
    done = run(tmp_path, 2, "--resume")
    assert done.returncode != 0 and "no complete checkpoint" in done.stderr, done.stderr[-2000:]
