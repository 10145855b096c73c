# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""The MindSpore trainer's checkpoints (``--backend mindspore``, safetensors-shards): a run at
tp=2 x dp_shard=2 on 4 mccl ranks saves at steps 2 and 4 (warmup, cosine decay and clipping);
its step-2 checkpoint, resumed under HSDP (2 replicas x 2 shards, tp=1, 2 accumulation
micro-steps) on the same 4 ranks, continues the loss curve of the uninterrupted run, and both
equal the torch trainer on one process (fp32: rtol 1.5e-4).  The checkpoint holds the model,
AdamW's moments of every parameter and its step count, and the trainer's record."""

from __future__ import annotations

import json
import shutil

import numpy as np
from train_ms_cases import TOL, _worst_rel, job, ms_run, torch_single

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})

FLAGS = ["--steps", "4", "--seq-len", "16", "--batch-size", "8", "--checkpoint-every", "2", "--max-grad-norm", "1.0",
         "--lr-warmup-steps", "1", "--lr-decay", "cosine"]


def test_saved_at_tp2_fsdp_resumes_under_hsdp(ms_pool: RankPool, torch_pool: RankPool, tmp_path) -> None:
    saved_dir, resumed_dir = tmp_path / "saved", tmp_path / "resumed"
    args, layout = job(["--backend", "mindspore", *FLAGS, "--tp", "2", "--dp-shard", "2", "--nproc", "4",
                        "--checkpoint-dir", str(saved_dir)], 4, str(tmp_path / "ms"))
    torch_args, one = job([*FLAGS, "--nproc", "1", "--tp", "1", "--dp-shard", "1", "--checkpoint-every", "100",
                           "--checkpoint-dir", str(tmp_path / "torch")], 1, str(tmp_path / "torch-out"))
    weights = str(tmp_path / "initial.npz")
    (ref,) = torch_pool.run(torch_single, torch_args, one, weights)
    full = ms_pool.run(ms_run, args, layout, weights)[0]

    step2 = saved_dir / "step-00000002"
    assert sorted(p.name for p in saved_dir.iterdir()) == ["step-00000002", "step-00000004"]
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["kind"] == "safetensors-shards" and manifest["framework"] == "mindspore"
    assert sorted(manifest["files"]) == [f"shard-rank{r:05d}.safetensors" for r in range(4)]
    record = manifest["extra"]["user"]
    assert record["step"] == record["data_position"] == 2 and record["losses"] == full["losses"][:2]
    assert record["layout"]["tp"] == 2 and record["layout"]["dp_shard"] == 2
    assert manifest["extra"]["values"] == {"adam_step": 2}
    tensors = manifest["tensors"]
    params = [k[len("model."):] for k in tensors if k.startswith("model.")]
    moments = [k for k in tensors if k.startswith("optim.")]
    assert len(moments) == 2 * len(params) and len(params) > 10, (len(params), len(moments))
    for name in params:  # each moment laid out as its parameter: the same global shape
        for kind in ("exp_avg", "exp_avg_sq"):
            assert tensors[f"optim.{name}.{kind}"]["shape"] == tensors[f"model.{name}"]["shape"]

    resumed_dir.mkdir()
    shutil.copytree(step2, resumed_dir / "step-00000002")
    hsdp_args, hsdp = job(["--backend", "mindspore", *FLAGS, "--tp", "1", "--dp-shard", "2", "--nproc", "4",
                           "--local-batch-size", "1", "--resume", "--checkpoint-dir", str(resumed_dir)], 4,
                          str(tmp_path / "hsdp"))
    assert (hsdp.dims.dp_replicate, hsdp.dims.dp_shard, hsdp.tp, hsdp.accumulation) == (2, 2, 1, 2)
    runs = ms_pool.run(ms_run, hsdp_args, hsdp, weights)
    resumed = runs[0]
    for r in runs[1:]:
        assert r["losses"] == resumed["losses"]
    assert resumed["start_step"] == 2 and len(resumed["losses"]) == 4
    assert resumed["losses"][:2] == full["losses"][:2]  # the losses so far, from the checkpoint's record
    np.testing.assert_allclose(resumed["losses"][2:], full["losses"][2:], err_msg="resumed vs uninterrupted", **TOL)
    np.testing.assert_allclose(full["losses"], ref["losses"], err_msg="MindSpore vs the torch trainer", **TOL)
    np.testing.assert_allclose(resumed["losses"][2:], ref["losses"][2:], err_msg="resumed vs torch", **TOL)
    assert resumed["learning_rates"] == ref["learning_rates"][2:]
    saved = json.loads((resumed_dir / "step-00000004" / "manifest.json").read_text())["extra"]
    assert saved["values"] == {"adam_step": 4} and saved["user"]["layout"]["dp_replicate"] == 2
    print(f"tp=2 x dp_shard=2 -> HSDP 2x2 at step 2: resumed losses {resumed['losses'][2:]}, uninterrupted "
          f"{full['losses'][2:]}; worst rel diff {_worst_rel(resumed['losses'][2:], full['losses'][2:]):.1e}, vs torch "
          f"{_worst_rel(resumed['losses'][2:], ref['losses'][2:]):.1e}")
