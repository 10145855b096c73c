# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The train command: bad flags fail at once, a short tp=2 run learns and matches tp=1, writes its
outputs, and an interrupted run resumes with the same losses."""

from __future__ import annotations

import json
import os

import pytest

from hp_models import train

SHORT = ["--seq-len", "16", "--batch-size", "8", "--lr", "1e-2"]


@pytest.mark.parametrize("argv,words", [
    (["--tp", "3"], ["tp=3 does not divide", "num_attention_heads=8"]),
    (["--config", "/nonexistent/config.json"], ["does not exist"]),
    (["--seq-len", "15"], ["--seq-len 15", "--tp 2"]),
    (["--resume", "--checkpoint-dir", "/nonexistent/ckpt"], ["no complete checkpoint", "/nonexistent/ckpt"]),
])
def test_bad_flags_fail_before_starting(argv: list[str], words: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert all(w in str(info.value.code) for w in words), info.value.code


def test_world_size_mismatch(monkeypatch) -> None:
    # 4 launched ranks at tp=2 are a valid FSDP x TP job now; 3 ranks cannot hold tp=2 groups
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as info:
        train.main(["--tp", "2"])
    msg = str(info.value.code)
    assert "launched with WORLD_SIZE=3" in msg and "world_size 3 is not divisible by tensor_parallel" in msg, msg
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as info:
        train.main(["--tp", "2", "--nproc", "2"])
    assert "--nproc 2 disagrees with the launcher's ranks" in str(info.value.code)


def test_bad_numbers_are_argparse_errors(capsys) -> None:
    with pytest.raises(SystemExit):
        train.main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--keep", "0"])
    assert "--keep must be >= 1" in capsys.readouterr().err


def test_short_run_learns_matches_tp1_and_resumes(tmp_path) -> None:
    full = tmp_path / "full"
    assert train.main(["--steps", "12", "--checkpoint-every", "6", "--out-dir", str(full), "--compare-single", *SHORT]) == 0
    log = json.loads((full / "log.json").read_text())
    losses = log["losses"]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert log["max_loss_diff_vs_single"] < 1e-4
    assert (full / "loss.png").stat().st_size > 1000
    # sharded checkpoints at steps 6 and 12 (--keep 2), each complete with its manifest
    assert sorted(os.listdir(full / "checkpoint")) == ["step-00000006", "step-00000012"]
    manifest = json.loads((full / "checkpoint" / "step-00000012" / "manifest.json").read_text())
    # the default format at pp=1: one safetensors file per rank
    assert manifest["extra"]["user"]["losses"] == losses and manifest["kind"] == "safetensors-shards"
    assert {"shard-rank00000.safetensors", "shard-rank00001.safetensors"} == set(manifest["files"])
    # interrupted after 6 steps, then resumed to 12: the same losses, bit for bit
    part = tmp_path / "part"
    assert train.main(["--steps", "6", "--checkpoint-every", "6", "--out-dir", str(part), *SHORT]) == 0
    assert train.main(["--steps", "12", "--checkpoint-every", "6", "--out-dir", str(part), "--resume", *SHORT]) == 0
    resumed = json.loads((part / "log.json").read_text())
    assert resumed["resumed_from_step"] == 6 and resumed["losses"] == losses


def test_checkpoint_format_default_is_shards_and_dcp_under_pipeline_parallelism() -> None:
    """safetensors-shards unless asked otherwise, except that a torch run with pp > 1 saves DCP (a
    stage holds only its own layers); MindSpore always saves shards."""
    from hp_checkpoint.manifest import CheckpointKind

    plain = train.parse_args([])
    assert plain.save_format(1) is CheckpointKind.SAFETENSORS_SHARDS
    assert plain.save_format(2) is CheckpointKind.DCP
    assert train.parse_args(["--checkpoint-format", "dcp"]).save_format(1) is CheckpointKind.DCP
    assert train.parse_args(["--backend", "mindspore"]).save_format(1) is CheckpointKind.SAFETENSORS_SHARDS
