# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""A run crossing frameworks through its checkpoints (safetensors-shards): the torch trainer at
tp=2 on 2 gloo ranks trains 6 steps (warmup, cosine decay, clipping; saves at 2, 4 and 6); the
MindSpore trainer resumes its step-2 checkpoint at dp_shard=2 x tp=2 on 4 mccl ranks and trains
to step 4; the torch trainer resumes MindSpore's step-4 checkpoint at dp_shard=2 (FSDP, no TP) on
the 2 gloo ranks and trains to step 6.  Every resumed loss equals the uninterrupted torch run's
(fp32: rtol 1.5e-4), and so do the learning rates.  The MindSpore backend refuses, before any rank
starts, to resume a DCP checkpoint (torch's own format), saying how to get one it can resume."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from train_ms_cases import TOL, _worst_rel, job, ms_run, torch_ranks

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models.trainer.args import parse_args
from hp_models.trainer.checks import check_args

ms_pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})

FLAGS = ["--seq-len", "16", "--batch-size", "8", "--checkpoint-every", "2", "--keep", "3", "--max-grad-norm", "1.0",
         "--lr-warmup-steps", "1", "--lr-decay", "cosine", "--lr-decay-steps", "5"]


def _step_copy(src, dst, step: int) -> None:
    dst.mkdir()
    shutil.copytree(src / f"step-{step:08d}", dst / f"step-{step:08d}")


def test_torch_to_mindspore_and_back_continue_the_torch_run(ms_pool: RankPool, torch_pool: RankPool,
                                                            tmp_path) -> None:
    torch_dir, ms_dir, back_dir = tmp_path / "torch", tmp_path / "ms", tmp_path / "back"
    weights = str(tmp_path / "initial.npz")
    args, tp2 = job([*FLAGS, "--steps", "6", "--tp", "2", "--nproc", "2", "--checkpoint-format", "safetensors-shards",
                     "--checkpoint-dir", str(torch_dir)], 2, str(tmp_path / "t"))
    straight = torch_pool.run(torch_ranks, args, tp2, weights)[0]
    assert len(straight["losses"]) == 6
    step2 = json.loads((torch_dir / "step-00000002" / "manifest.json").read_text())
    assert step2["kind"] == "safetensors-shards" and step2["framework"] == "torch"
    assert step2["extra"]["values"] == {"adam_step": 2} and "rng.torch_cpu" in step2["tensors"]

    # torch tp=2 -> MindSpore dp_shard=2 x tp=2, steps 3-4
    _step_copy(torch_dir, ms_dir, 2)
    ms_args, ms_layout = job(["--backend", "mindspore", *FLAGS, "--steps", "4", "--tp", "2", "--dp-shard", "2",
                              "--nproc", "4", "--resume", "--checkpoint-dir", str(ms_dir)], 4, str(tmp_path / "m"))
    runs = ms_pool.run(ms_run, ms_args, ms_layout, weights)
    on_ms = runs[0]
    for r in runs[1:]:
        assert r["losses"] == on_ms["losses"]
    assert on_ms["start_step"] == 2 and on_ms["losses"][:2] == straight["losses"][:2]
    np.testing.assert_allclose(on_ms["losses"][2:], straight["losses"][2:4], err_msg="torch -> MindSpore", **TOL)
    assert on_ms["learning_rates"] == straight["learning_rates"][2:4]
    step4 = json.loads((ms_dir / "step-00000004" / "manifest.json").read_text())
    assert step4["framework"] == "mindspore" and step4["extra"]["values"] == {"adam_step": 4}
    assert "rng.torch_cpu" not in step4["tensors"]

    # MindSpore dp_shard=2 x tp=2 -> torch dp_shard=2 (tp=1), steps 5-6
    _step_copy(ms_dir, back_dir, 4)
    back_args, fsdp = job([*FLAGS, "--steps", "6", "--tp", "1", "--dp-shard", "2", "--nproc", "2", "--resume",
                           "--checkpoint-format", "safetensors-shards", "--checkpoint-dir", str(back_dir)], 2,
                          str(tmp_path / "b"))
    on_torch = torch_pool.run(torch_ranks, back_args, fsdp)
    assert on_torch[0]["losses"] == on_torch[1]["losses"]
    back = on_torch[0]
    assert back["start_step"] == 4 and len(back["losses"]) == 6
    np.testing.assert_allclose(back["losses"][:4], straight["losses"][:4], err_msg="the record", **TOL)
    np.testing.assert_allclose(back["losses"][4:], straight["losses"][4:], err_msg="MindSpore -> torch", **TOL)
    assert back["learning_rates"] == straight["learning_rates"][4:]
    print(f"torch tp=2 -> MindSpore 2x2 at step 2: worst rel diff {_worst_rel(on_ms['losses'][2:], straight['losses'][2:4]):.1e}"
          f"; MindSpore -> torch dp_shard=2 at step 4: {_worst_rel(back['losses'][4:], straight['losses'][4:]):.1e}; "
          f"losses {straight['losses']}")


def test_mindspore_refuses_to_resume_a_dcp_checkpoint(torch_pool: RankPool, tmp_path) -> None:
    ckpt = tmp_path / "dcp"
    args, tp2 = job(["--backend", "torch", "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--tp", "2", "--nproc", "2",
                     "--checkpoint-format", "dcp", "--checkpoint-dir", str(ckpt)], 2, str(tmp_path / "t"))
    torch_pool.run(torch_ranks, args, tp2)
    assert json.loads((ckpt / "step-00000001" / "manifest.json").read_text())["kind"] == "dcp"
    with pytest.raises(SystemExit) as e:
        check_args(parse_args(["--backend", "mindspore", "--steps", "2", "--seq-len", "16", "--batch-size", "2",
                               "--resume", "--checkpoint-dir", str(ckpt), "--out-dir", str(tmp_path / "m")]))
    line = str(e.value.code)
    assert line.startswith(f"error: --resume from {ckpt / 'step-00000001'}: a dcp checkpoint (written by torch)"), line
    assert "--checkpoint-format safetensors-shards" in line, line
