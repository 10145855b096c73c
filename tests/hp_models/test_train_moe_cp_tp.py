# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The MoE trainer under context and tensor parallelism together on 4 gloo ranks (cp=2 x tp=2):
the TP plan without sequence parallelism, each MoE block running on its TP rank's half of the CP
rank's tokens, with ep=2 (the ep group is the TP group), ep=4 over the deredundancy dispatcher
(EP across the CP and TP ranks, with full activation checkpointing), ep=1 (each expert TP-split
over etp=2 and fully sharded over the CP ranks) and ulysses with ep=2 (selective activation
checkpointing).  Each reports the losses of the same run on one process (the trainer's
``--compare-single`` reference) and the same tokens per expert in every layer and step, and every
rank holds its share of each parameter as the layout says."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from moe_shares import EP, ETP, check_equals_one_process, check_shares, train_and_hold

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

STEPS = 3
SEQ = 32
SHORT = ["--config", "tiny-moe", "--nproc", "4", "--steps", str(STEPS), "--seq-len", str(SEQ), "--lr", "1e-2",
         "--checkpoint-every", "100"]
CAUSAL = {"model": {"use_attn_mask_compression": True}}
TRAINING = {"global_batch_size": 8, "local_batch_size": 2}
CP_TP = {"context_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 1}


def _job(tmp_path, parallelism: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"parallelism": {**CP_TP, **parallelism}, "training": TRAINING, **CAUSAL}))
    return str(path)


@pytest.mark.parametrize("parallelism,flags,layout,experts", [
    ({"expert_parallel": 2}, [], {"cp": 2, "tp": 2, "ep": 2, "efsdp": 2, "accumulation_steps": 4}, EP),
    # the block's token cut and gather and the dispatch's all-to-alls rerun in the recomputation
    ({"expert_parallel": 4, "moe_token_dispatcher_type": "alltoall_deredundancy", "npu_nums_per_device": 2},
     ["--activation-checkpoint", "full"], {"cp": 2, "tp": 2, "ep": 4, "efsdp": 1, "activation_checkpoint": "full"},
     EP),
    ({"expert_parallel": 1}, [], {"cp": 2, "tp": 2, "etp": 2, "edp": 2}, ETP),
    ({"expert_parallel": 2, "context_parallel_method": "ulysses", "ulysses_degree_in_cp": 2},
     ["--activation-checkpoint", "selective"],
     {"cp": 2, "cp_method": "ulysses", "tp": 2, "ep": 2, "efsdp": 2, "activation_checkpoint": "selective every 2"}, EP),
], ids=["colossal-ep2", "colossal-ep4-deredundancy-full-ac", "colossal-etp2", "ulysses-ep2-selective-ac"])
def test_moe_cp_tp_equals_one_process(pool4: RankPool, parallelism: dict[str, Any], flags: list[str],
                                      layout: dict[str, Any], experts: dict[str, Any], tmp_path) -> None:
    argv = ["--job", _job(tmp_path, parallelism), *SHORT, *flags]
    res = pool4.run(train_and_hold, [*argv, "--out-dir", str(tmp_path / "run")])
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    # the router statistics are summed over the 2 CP x 2 TP ranks that split each sequence's tokens
    assert all(r["token_mesh"] == (("cp", "tp"), 4) for r in res), [r["token_mesh"] for r in res]
    check_shares([r["params"] for r in res], experts)
    check_equals_one_process(res, argv, tmp_path / "single", SEQ, "train moe cp x tp")


def test_cp_shards_the_tp_ranks_cannot_split_fail_before_any_rank_starts(tmp_path) -> None:
    """Each MoE block splits a CP rank's tokens over the TP ranks: a sequence length that
    ``2 * cp`` divides (the load-balanced CP split) but ``cp * tp`` does not is refused."""
    job = _job(tmp_path, {"tensor_parallel": 4, "expert_parallel": 2})
    with pytest.raises(SystemExit) as info:
        train.main(["--job", job, *SHORT, "--nproc", "8", "--seq-len", "36", "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    words = ["--seq-len 36 over context_parallel 2 and tensor_parallel 4", "18 tokens over the 4 TP ranks",
             "a multiple of 8"]
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()
