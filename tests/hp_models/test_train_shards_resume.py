# mypy: disable-error-code="no-untyped-def"
"""The torch trainer's safetensors-shards checkpoints (``--checkpoint-format safetensors-shards``,
the format MindSpore reads too) on one process: a run of 3 steps, stopped after step 1 and resumed,
gives the straight run's losses bit for bit; the checkpoint holds the model, AdamW's moments and
step count and the generator state.  Pipeline parallelism (each stage holds its own layers) is
refused with this format before any rank starts.  A run saved in DCP and resumed in the default
format (safetensors-shards) continues the straight run bit for bit, its old steps pruned.  (Resharding and crossing
to MindSpore on real ranks: ``tests/hp_models/mindspore/test_train_ms_torch_resume.py``.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hp_models import train

SHORT = ["--seq-len", "16", "--batch-size", "4", "--lr", "1e-2", "--tp", "1", "--backend", "torch",
         "--checkpoint-format", "safetensors-shards", "--checkpoint-every", "1", "--keep", "3"]


def test_stopped_and_resumed_equals_the_straight_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train.main(["--out-dir", str(out), *SHORT, "--steps", "3"]) == 0
    assert "checkpoint (safetensors-shards) in" in capsys.readouterr().out
    straight = json.loads((out / "log.json").read_text())["losses"]
    step1 = out / "checkpoint" / "step-00000001"
    manifest = json.loads((step1 / "manifest.json").read_text())
    assert manifest["kind"] == "safetensors-shards" and manifest["framework"] == "torch"
    assert manifest["extra"]["values"] == {"adam_step": 1} and manifest["extra"]["user"]["losses"] == straight[:1]
    assert {"model.lm_head.weight", "optim.lm_head.weight.exp_avg", "optim.lm_head.weight.exp_avg_sq",
            "rng.torch_cpu"} <= set(manifest["tensors"])

    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(step1, resumed / "checkpoint" / "step-00000001")
    assert train.main(["--out-dir", str(resumed), *SHORT, "--steps", "3", "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert json.loads((resumed / "log.json").read_text())["losses"] == straight
    saved_rng = json.loads((step1 / "manifest.json").read_text())["tensors"]["rng.torch_cpu"]
    assert saved_rng["dtype"] == "uint8" and tuple(saved_rng["shape"]) == tuple(torch.get_rng_state().shape)
    assert sorted(os.listdir(resumed / "checkpoint")) == ["step-00000001", "step-00000002", "step-00000003"]


def test_pipeline_parallelism_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    args = train.parse_args(["--out-dir", str(tmp_path), *SHORT, "--pp", "2", "--nproc", "2"])
    with pytest.raises(SystemExit) as info:
        train.check_args(args)
    msg = str(info.value.code)
    assert msg.startswith("error: --checkpoint-format safetensors-shards with pipeline_parallel=2"), msg
    assert "use --checkpoint-format dcp" in msg, msg
    assert not (tmp_path / "checkpoint").exists()


def test_a_dcp_run_resumed_in_the_default_format(tmp_path: Path, capsys) -> None:
    flags = [a for a in SHORT if a not in ("--checkpoint-format", "safetensors-shards")]
    straight = tmp_path / "straight"
    assert train.main(["--out-dir", str(straight), *flags, "--steps", "4"]) == 0
    out = tmp_path / "run"
    assert train.main(["--out-dir", str(out), *flags, "--steps", "2", "--checkpoint-format", "dcp"]) == 0
    assert train.main(["--out-dir", str(out), *flags, "--steps", "4", "--resume", "--keep", "2"]) == 0
    assert "checkpoint (safetensors-shards) in" in capsys.readouterr().out
    assert json.loads((out / "log.json").read_text())["losses"] == json.loads((straight / "log.json").read_text())[
        "losses"]
    kinds = {d: json.loads((out / "checkpoint" / d / "manifest.json").read_text())["kind"]
             for d in sorted(os.listdir(out / "checkpoint"))}
    assert kinds == {"step-00000003": "safetensors-shards", "step-00000004": "safetensors-shards"}, kinds
