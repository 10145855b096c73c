# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""Qwen3.5 on 2 MindSpore (mccl) ranks, tensor parallel through ``parallelize_qwen3_5_ms_tp``
(ShardingConfigs on the protocol Modules: vocab-parallel embedding, column-parallel projections
by head, row-parallel outputs, conv and per-head parameters split by head, lm_head split over the
vocab), with and without sequence parallelism and loss parallel.  Each rank loads the HF
checkpoint the torch model wrote and gives the torch model's logits and loss, and the gradient
shards assemble to the torch model's gradients (fp32, rtol 1.5e-4, atol 1e-5); one-process
MindSpore equals the same reference in ``test_qwen3_5_ms_parity.py``.  Each layout runs with its
own seed, tied and untied embeddings both covered, and the forward's collectives are counted."""

from __future__ import annotations

import numpy as np
import pytest
from qwen_ms_cases import assemble, ms_tp_run, torch_reference, worst

from hp_dtensor import Replicate, Shard
from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}


def expected_forward_collectives(layers: int, sp: bool, lp: bool) -> dict[str, int]:
    """What one forward issues: without sequence parallelism one all-reduce of the embedding and
    of each block's output (two blocks per layer); with it a reduce-scatter there instead and an
    all-gather into each block and into ``lm_head``.  The logits are gathered unless loss parallel
    keeps them split over the vocab."""
    counts = {"all_reduce": 1 + 2 * layers} if not sp else {"reduce_scatter": 1 + 2 * layers,
                                                             "all_gather": 2 * layers + 1}
    if not lp:
        counts["all_gather"] = counts.get("all_gather", 0) + 1
    return counts


@pytest.mark.parametrize(
    ("seed", "tie", "sp", "lp"),
    [(0, False, False, False), (1, True, False, False), (2, False, True, False), (3, True, True, True),
     (4, False, False, True)],
)
def test_tp2_equals_the_torch_model(
    ms_pool: RankPool, torch_pool: RankPool, seed: int, tie: bool, sp: bool, lp: bool, tmp_path
) -> None:
    folder = str(tmp_path)
    (ref,) = torch_pool.run(torch_reference, seed, tie, folder)
    runs = ms_pool.run(ms_tp_run, seed, tie, folder, sp, lp)
    layers = sum(1 for name in ref["grads"] if name.endswith("input_layernorm.weight"))
    for rank, run in enumerate(runs):
        assert run["forward_collectives"] == expected_forward_collectives(layers, sp, lp), (rank, sp, lp)
    for rank, run in enumerate(runs):
        np.testing.assert_allclose(run["logits"], ref["logits"], err_msg=f"rank {rank} logits", **TOL)
        np.testing.assert_allclose(run["loss"], ref["loss"], err_msg=f"rank {rank} loss", **TOL)
        assert set(run["grads"]) == set(ref["grads"])
    layout = runs[0]["placements"]
    assert layout["model.embed_tokens.weight"] == (Shard(0),)
    assert layout["model.layers.0.linear_attn.in_proj_q.weight"] == (Shard(0),)
    assert layout["model.layers.0.linear_attn.out_proj.weight"] == (Shard(1),)
    assert layout["model.layers.0.linear_attn.conv_v"] == (Shard(0),)
    assert layout["model.layers.0.linear_attn.norm.weight"] == (Replicate(),)
    assert layout["model.layers.3.self_attn.q_norm.weight"] == (Replicate(),)
    assert all(p is not None for p in layout.values()), "every parameter is a DTensor"
    shares = []
    for name in sorted(ref["grads"]):
        shards = [run["grads"][name] for run in runs]
        if layout[name] == (Replicate(),):
            np.testing.assert_allclose(shards[1], shards[0], err_msg=f"{name}: replicas differ", **TOL)
        whole = assemble(shards, layout[name])
        np.testing.assert_allclose(whole, ref["grads"][name], err_msg=f"{name}", **TOL)
        shares.append(worst(ref["grads"][name], whole) + (name,))
    logit_abs, logit_share = worst(ref["logits"], runs[0]["logits"])
    grad_abs, grad_share, grad_name = max(shares, key=lambda t: t[1])
    print(f"tp=2 sp={sp} lp={lp} tie={tie} seed={seed}: {runs[0]['forward_collectives']}; logits max abs diff {logit_abs:.2e} ({logit_share:.2f} of tol), loss "
          f"{ref['loss']:.7f} vs {runs[0]['loss']:.7f}, {len(shares)} gradients: worst {grad_share:.2f} of tol "
          f"(abs {grad_abs:.2e}) at {grad_name}")
