# mypy: disable-error-code="no-untyped-def"
"""The trainer's checkpoint directory guards (tiny model on one process, a few steps; one run on 2
ranks).

- A fresh run into a directory holding an earlier run's checkpoints is refused before it trains
  (it would prune its own saves as older than theirs, and a later ``--resume`` would continue the
  other run), naming ``--resume`` and ``--overwrite``; ``--overwrite`` deletes the old run's steps.
- ``--resume`` refuses a checkpoint of another run, naming each differing setting.
- ``--resume`` says which newer step directories it skipped and why.
- A damaged checkpoint ends the command with one ``error:`` line naming the file and what to do,
  in one process and from 2 ranks, whose launcher leaves no temporary folder behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp_checkpoint.manifest import read_manifest
from hp_models import train
from hp_models.trainer.resume import trainer_extra

SHORT = ["--seq-len", "16", "--batch-size", "8", "--lr", "1e-2", "--tp", "1"]


def _main(out: Path, *argv: str) -> int:
    return train.main(["--out-dir", str(out), *SHORT, *argv])


def test_a_fresh_run_does_not_mix_with_another_runs_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "run"
    ckpt = out / "checkpoint"
    assert _main(out, "--steps", "2", "--checkpoint-every", "1") == 0  # the earlier run: steps 1 and 2
    with pytest.raises(SystemExit) as info:  # a fresh, shorter run into the same directory
        _main(out, "--steps", "1", "--checkpoint-every", "1", "--seed", "3")
    msg = str(info.value.code)
    assert "already holds checkpoints of an earlier run" in msg and str(ckpt) in msg, msg
    assert "Pass --resume to continue that run, or --overwrite to delete them" in msg, msg
    assert sorted(os.listdir(ckpt)) == ["step-00000001", "step-00000002"]  # untouched
    # --resume continues only the same run: each differing setting is named
    with pytest.raises(SystemExit) as info:
        _main(out, "--steps", "3", "--resume", "--lr", "5e-3", "--seq-len", "32")
    msg = str(info.value.code)
    assert "was saved by another run: lr 0.01 (this run: 0.005); seq_len 16 (this run: 32)" in msg, msg
    assert "--overwrite" in msg, msg
    # --overwrite: the earlier run's steps go, the new run keeps its own
    assert _main(out, "--steps", "1", "--checkpoint-every", "1", "--seed", "3", "--overwrite") == 0
    assert sorted(os.listdir(ckpt)) == ["step-00000001"]
    assert trainer_extra(read_manifest(str(ckpt / "step-00000001")))["run"]["seed"] == 3
    with pytest.raises(SystemExit):
        train.parse_args(["--resume", "--overwrite"])


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def test_resume_names_what_it_skips_and_a_damaged_file_is_one_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    ckpt = out / "checkpoint"
    assert _main(out, "--steps", "2", "--checkpoint-every", "1") == 0
    os.remove(ckpt / "step-00000002" / "manifest.json")  # the newest step's save "did not finish"
    (ckpt / "step-00000003").mkdir()  # and an empty one
    capsys.readouterr()
    assert _main(out, "--steps", "2", "--resume") == 0
    err = capsys.readouterr().err
    assert (f"skipped {ckpt}/step-00000002 (newer, not a complete checkpoint): no manifest.json, so the save "
            f"that wrote it did not finish") in err, err
    assert f"skipped {ckpt}/step-00000003 (newer, not a complete checkpoint): the directory is empty" in err, err
    assert f"resuming from {ckpt}/step-00000001 (step 1," in err, err

    # a damaged file: one line, naming it and what to do, exit code 1
    _flip_a_byte(ckpt / "step-00000002" / "shard-rank00000.safetensors")
    assert _main(out, "--steps", "3", "--resume") == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"checkpoint {ckpt}/step-00000002: file 'shard-rank00000.safetensors' is corrupted" in errors[0], errors
    assert f"move {ckpt}/step-00000002 out of {ckpt} to resume from the checkpoint before it" in errors[0], errors

    # the same from 2 ranks (tp=2: the layout may change on resume): one line, once
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HP_CHECKPOINT_FAULT")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TMPDIR=str(tmp))
    cmd = [sys.executable, "-m", "hp_models.train", "--out-dir", str(out), *SHORT, "--tp", "2", "--steps", "3",
           "--resume"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "file 'shard-rank00000.safetensors' is corrupted" in errors[0] and "--resume: move" in errors[0], errors
    assert "layout changed since the save: " in done.stderr and "tp 1 -> 2" in done.stderr, done.stderr[-3000:]
    assert [n for n in os.listdir(tmp) if n.startswith("hp-train-")] == []
