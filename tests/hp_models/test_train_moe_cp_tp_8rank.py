# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The MoE trainer under context and tensor parallelism with data-parallel shards on 8 gloo
ranks: cp=2 x tp=2 x dp_shard=2 with ep=4 (the experts over ep, fully sharded over efsdp = 2:
FSDP of the dense parameters over dp_shard * cp = 4) and hybrid cp=4 (ulysses 2) x tp=2 with
ep=2, and pp=2 x cp=2 x tp=2 with ep=2 (context and tensor parallelism inside the pipeline
stages) report the losses of the same run on one process and the same tokens per expert in every
layer and step; every rank holds its share of each parameter as the layout says."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from moe_shares import EP, check_equals_one_process, check_shares, train_and_hold

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool8 = rank_pool_fixture(8, timeout=300)

STEPS = 3
SEQ = 32
SHORT = ["--config", "tiny-moe", "--nproc", "8", "--steps", str(STEPS), "--seq-len", str(SEQ), "--lr", "1e-2",
         "--checkpoint-every", "100"]


@pytest.mark.parametrize("parallelism,layout,token_ranks", [
    ({"context_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 4},
     {"cp": 2, "tp": 2, "dp_shard": 2, "ep": 4, "efsdp": 2, "accumulation_steps": 2}, 4),
    ({"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 2, "tensor_parallel": 2,
      "data_parallel_shard": 1, "expert_parallel": 2},
     {"cp": 4, "cp_method": "hybrid", "ulysses_degree": 2, "tp": 2, "ep": 2, "efsdp": 4}, 8),
    # and inside pipeline stages: each CP x TP rank's statistics travel with its hidden states
    ({"context_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": "auto",
      "data_parallel_shard": 1, "expert_parallel": 2},
     {"pp": 2, "cp": 2, "tp": 2, "ep": 2, "efsdp": 2, "stage_layers": [[0, 1], [2, 3]]}, None),
], ids=["colossal-cp2-tp2-dp2-ep4", "hybrid-cp4-u2-tp2-ep2", "pp2-cp2-tp2-ep2"])
def test_moe_cp_tp_dp_equals_one_process(pool8: RankPool, parallelism: dict[str, Any], layout: dict[str, Any],
                                         token_ranks: int | None, tmp_path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"parallelism": parallelism, "model": {"use_attn_mask_compression": True},
                                   "training": {"global_batch_size": 8, "local_batch_size": 2}}))
    argv = ["--job", str(job), *SHORT]
    res = pool8.run(train_and_hold, [*argv, "--out-dir", str(tmp_path / "run")])
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    # the router statistics are summed over the CP x TP ranks that split each sequence's tokens
    # (under the pipeline by the last stage's loss, over its CP x TP ranks: test_train_moe_pp)
    if token_ranks is not None:
        assert all(r["token_mesh"] == (("cp", "tp"), token_ranks) for r in res), [r["token_mesh"] for r in res]
    check_shares([r["params"] for r in res], EP)
    check_equals_one_process(res, argv, tmp_path / "single", SEQ, "train moe cp x tp x dp")
