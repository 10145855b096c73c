"""The trainer under real ``kill -9`` (tiny model, tp=2 on 2 spawned ranks, 6 steps).

- A rank killed at each point of a save (fault hook: staging made, files written, before the
  manifest, before the rename, after it) and ranks killed at random moments from outside: the
  job stops, the checkpoint before it is never lost, and every checkpoint left is, file for file,
  the uninterrupted run's of the same step (never a mix); ``--resume`` picks the newest and the
  resumed loss curve equals the uninterrupted run's bit for bit.  Trials are counted in the output.
- Resuming at another parallelism (tp=1 x dp_shard=2 from tp=2) reshards model and AdamW state:
  the loss curve continues within float reassociation.
- Killing the launcher with SIGKILL stops every rank; ``--resume`` without a complete checkpoint
  is refused before any rank starts.

Each run's launcher is a process of its own forked from a server that imported the trainer once
(its ranks are spawned by the trainer as always), instead of an interpreter per run re-importing
torch and the model.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from hp_checkpoint.manifest import complete_checkpoints, verify_checkpoint

STEPS = 6
FLAGS = ["--seq-len", "16", "--batch-size", "8", "--lr", "1e-2"]
POINTS = [("staged", 1), ("files-written", 1), ("before-manifest", 0), ("before-commit", 0), ("after-commit", 0)]
# Crash trials whose resume also runs to the end (the others' checkpoints are compared file by
# file with the uninterrupted run's, which fixes their resumed runs too): at the same layout, and
# at tp=1 x dp_shard=2 (the state reshards).
RESUME_SAME = ("files-written", "after-commit")
RESUME_RESHARD = "before-commit"
RANDOM_TRIALS = 4


# Launchers are forked from a server that has only imported the trainer (no thread pool used).
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "hp_models.train", "hp_models.qwen3_5", "hp_checkpoint.manifest"])


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HP_CHECKPOINT_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if fault is not None:
        env["HP_CHECKPOINT_FAULT"] = fault
    return env


def _argv(out: Path, steps: int, *extra: str) -> list[str]:
    return ["--steps", str(steps), "--out-dir", str(out), *FLAGS, *extra]


def _launcher_main(argv: list[str], env: dict[str, str], err_path: str) -> None:
    """``python -m hp_models.train <argv>`` in this process: its environment, its stderr into a
    file; an uncaught error prints its traceback there and exits 1, as the command does."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    from hp_models import train

    sys.exit(train.main(argv))


class _Launcher:
    """A trainer run's launcher process (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.err_path = os.path.join(tempfile.mkdtemp(prefix="hp-launcher-"), "stderr")
        self.proc = _ctx.Process(target=_launcher_main, args=(argv, env, self.err_path))
        self.proc.start()
        assert self.proc.pid is not None
        self.pid: int = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float) -> int:
        self.proc.join(timeout)
        assert self.proc.exitcode is not None, f"the launcher is still running after {timeout} s"
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    @property
    def stderr(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()


def _start(out: Path, steps: int, *extra: str, fault: str | None = None) -> _Launcher:
    return _Launcher(_argv(out, steps, *extra), _env(fault))


def _run(out: Path, steps: int, *extra: str, fault: str | None = None) -> _Launcher:
    launcher = _start(out, steps, *extra, fault=fault)
    launcher.wait(300)
    return launcher


def _losses(out: Path) -> list[float]:
    return list(json.loads((out / "log.json").read_text())["losses"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: Any) -> tuple[list[float], Path]:
    """The uninterrupted run: 6 steps, a checkpoint after every step, all kept."""
    out = tmp_path_factory.mktemp("reference")
    done = _run(out, STEPS, "--checkpoint-every", "1", "--keep", str(STEPS))
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(out), out / "checkpoint"


def _same_as_reference(path: str, ref_root: Path) -> None:
    """A checkpoint left by a crashed run is, file for file, the uninterrupted run's checkpoint of
    the same step (shard files are deterministic at one layout; ``.metadata`` holds a save id),
    with the same losses: model, optimizer, generator and data position all equal, no mix."""
    got = verify_checkpoint(path)
    want = verify_checkpoint(str(ref_root / os.path.basename(path)))
    shards = {k: v for k, v in got.files.items() if k.endswith(".distcp")}
    assert shards and shards == {k: v for k, v in want.files.items() if k.endswith(".distcp")}, path
    assert got.extra["losses"] == want.extra["losses"] and got.tensors == want.tensors, path


def _resume(out: Path, path: str, step: int, *layout: str, announced: tuple[str, ...] = ()) -> list[float]:
    resumed = _run(out, STEPS, "--checkpoint-every", "2", "--resume", *layout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {path} (step {step}" in resumed.stderr, resumed.stderr[-2000:]
    assert all(a in resumed.stderr for a in announced), resumed.stderr[-2000:]
    return _losses(out)


def test_kill_at_each_point_of_a_save(reference: tuple[list[float], Path], tmp_path: Path, capsys: Any) -> None:
    ref_losses, ref_root = reference
    trials = lost = resumed_runs = 0
    resumed_from: dict[str, int] = {}
    reshard_rel = -1.0
    for point, rank in POINTS:
        out = tmp_path / f"{point}-{rank}"
        crashed = _run(out, STEPS, "--checkpoint-every", "2", fault=f"{point}@{rank}:4")
        assert crashed.returncode != 0, (point, crashed.stderr[-2000:])
        # the launcher names the rank that died and how, first (not a survivor's connection error)
        assert f"error: rank {rank} was killed by SIGKILL (signal 9)" in crashed.stderr, crashed.stderr[-2000:]
        found = complete_checkpoints(str(out / "checkpoint"))
        steps = [s for s, _ in found]
        newest, path = found[-1]
        assert newest == (4 if point == "after-commit" else 2), (point, steps)
        lost += 0 if 2 in steps else 1
        for _, p in found:
            _same_as_reference(p, ref_root)
        if point in RESUME_SAME:
            assert _resume(out, path, newest) == ref_losses  # same layout: bit for bit
            resumed_runs += 1
        elif point == RESUME_RESHARD:
            got = _resume(out, path, newest, "--tp", "1", "--dp-shard", "2",
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


def _rank_pids(launcher: int) -> list[int]:
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    out = []
    for pid in kids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmd:
            out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _saving(root: Path) -> bool:
    """A save is under way (or was cut short): a staging directory exists."""
    return any(n.startswith(".staging-") for n in os.listdir(root))


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
        proc = _start(out, STEPS, "--checkpoint-every", "1")
        root = out / "checkpoint"
        first = root / "step-00000001" / "manifest.json"
        assert _wait_for(first.exists, 240), "no first checkpoint"
        # aim at a save: wait for a later one to start, then kill at a random moment of it or after
        assert _wait_for(lambda r=root, p=proc: _saving(r) or p.poll() is not None, 240)
        time.sleep(rng.uniform(0.0, 0.4))
        ranks = _rank_pids(proc.pid)
        found = complete_checkpoints(str(root))
        if len(ranks) < 2 or proc.poll() is not None:
            proc.wait(timeout=120)
            continue
        before = found[-1][0]  # the newest complete checkpoint at the kill
        os.kill(rng.choice(ranks), signal.SIGKILL)
        proc.wait(timeout=120)
        if proc.returncode == 0:  # the kill landed after the last step: not a crash
            continue
        during_save += _saving(root)
        found = complete_checkpoints(str(root))
        for _, p in found:
            _same_as_reference(p, ref_root)
        newest, path = found[-1]
        lost += 0 if newest >= before else 1
        left.append(newest)
        if trials == 0:
            assert _resume(out, path, newest) == ref_losses
        trials += 1
        assert _wait_for(lambda pids=ranks: not any(_alive(p) for p in pids), 30)
    with capsys.disabled():
        print(f"\nrandom kills: {trials} trials ({during_save} inside a save), {lost} checkpoints lost, 0 mixes; "
              f"newest complete checkpoints left: steps {left}; the first resumed to the end bit for bit")
    assert trials >= RANDOM_TRIALS - 1 and lost == 0


def test_killing_the_launcher_stops_the_ranks(tmp_path: Path) -> None:
    out = tmp_path / "orphans"
    proc = _start(out, 500, "--checkpoint-every", "1", "--keep", "1")
    try:
        # the ranks are training (a rank still importing when its launcher dies exits as soon as
        # its worker starts: it finds its parent gone)
        first = out / "checkpoint" / "step-00000001" / "manifest.json"
        assert _wait_for(first.exists, 240), "the ranks did not start training"
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2 and all(_alive(p) for p in ranks), ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _wait_for(lambda: not any(_alive(p) for p in ranks), 10.0), [p for p in ranks if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_resume_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoint" / ".staging-step-00000002-abc").mkdir(parents=True)  # a crashed save only
    done = _run(tmp_path, 2, "--resume")
    assert done.returncode != 0 and "no complete checkpoint" in done.stderr, done.stderr[-2000:]
