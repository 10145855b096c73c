# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The TP plan at tp=2 and tp=4 on gloo: logits, loss and every gradient equal the unsharded
model; per-rank parameter bytes are exactly the sharded share; collectives per layer are what the
plan implies."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)
pool4 = rank_pool_fixture(4, timeout=300)


def _setup(world: int, **cfg_overrides: Any) -> tuple[Any, Any, Any]:
    import torch

    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import tiny_config

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = tiny_config(chunk_size=8, **cfg_overrides)
    torch.manual_seed(0)
    ref = cfg.build()
    ref.init_weights()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return mesh, cfg, ref


def _equal_to_unsharded(rank: int, world: int, sp: bool, lp: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp
    from hp_tp import loss_parallel

    mesh, cfg, ref = _setup(world)
    model = parallelize_qwen3_5_tp(copy.deepcopy(ref), mesh, sequence_parallel=sp, loss_parallel=lp)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    ref_logits = ref(ids)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), tgt.flatten())
    ref_loss.backward()
    with CommDebugMode() as fwd:
        logits = model(ids)
    torch.testing.assert_close(logits.full_tensor(), ref_logits, rtol=1.5e-4, atol=1e-5)
    with CommDebugMode() as loss_bwd:
        if lp:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.to_local().flatten(0, 1), tgt.flatten())
            loss.backward()
    loss_value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    torch.testing.assert_close(loss_value, ref_loss, rtol=1.5e-4, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    local_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    partial_grads = sorted(n for n, p in model.named_parameters() if any(pl.is_partial() for pl in p.grad.placements))
    return {"fwd": fwd.get_comm_counts(), "loss_bwd": loss_bwd.get_comm_counts(), "bytes": local_bytes,
            "partial_grads": partial_grads}


def _expected_local_bytes(world: int) -> int:
    """The sharded share, computed from the config alone (4 bytes per fp32 element)."""
    from hp_models.qwen3_5 import tiny_config

    c = tiny_config()
    h, v, i = c.hidden_size, c.vocab_size, c.intermediate_size
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    nv, hd = c.linear_num_value_heads, c.head_dim
    sharded = v * h + v * h  # embed rows, lm_head rows
    replicated = h  # final norm
    for t in c.layer_types:
        sharded += 3 * h * i
        replicated += 2 * h
        if t == "linear_attention":
            sharded += h * (2 * kd + 2 * vd + 2 * nv) + vd * h  # in_proj q,k,v,z,b,a + out_proj
            sharded += (2 * kd + vd) * c.linear_conv_kernel_dim + 2 * nv  # convs, dt_bias, A_log
            replicated += c.linear_value_head_dim  # gated norm
        else:
            sharded += h * (c.num_attention_heads * hd * 2 + 2 * c.num_key_value_heads * hd)
            sharded += c.num_attention_heads * hd * h
            replicated += 2 * hd  # q_norm, k_norm
    return 4 * (sharded // world + replicated)


@pytest.mark.parametrize("sp,lp", [(True, True), (False, False), (False, True)],
                         ids=["sp_lossparallel", "no_sp", "no_sp_lossparallel"])
def test_tp2_equals_unsharded(pool2: RankPool, sp: bool, lp: bool) -> None:
    """Also the collectives of a whole step, counted so that a change of plan cannot add any
    unnoticed (the hand-written Megatron model of ``benchmarks/qwen3_5_megatron.py`` issues the
    same per block)."""
    layers = 4
    for res in pool2.run(_equal_to_unsharded, sp, lp, timeout=180):
        assert res["bytes"] == _expected_local_bytes(2)
        if sp:
            # per layer: token-mixer entry all_gather + its reduce_scatter, MLP entry all_gather +
            # down_proj reduce_scatter; plus embed reduce_scatter and lm_head all_gather
            assert res["fwd"] == {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1}
            # backward mirrors forward; loss parallel adds 2 all_reduce fwd (row max, stacked row
            # sums) and none in bwd, no vocab gather
            assert res["loss_bwd"] == {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1,
                                       "all_reduce": 2}
        else:
            # per layer: token-mixer and MLP outputs all-reduced; plus the embedding's
            assert res["fwd"] == {"all_reduce": 2 * layers + 1, **({} if lp else {"all_gather": 1})}
            # backward: the input gradient of each token mixer, MLP and lm_head all-reduced once,
            # where it enters the norm before it (the norms run on local tensors), so the norm
            # weights' gradients come out whole; loss parallel adds its 2 forward all_reduces
            assert res["loss_bwd"] == {"all_reduce": 2 * layers + 1 + (2 if lp else 0)}
            assert all(".linear_attn.norm." in n or "_norm." in n for n in res["partial_grads"]), res["partial_grads"]


def test_tp4_equals_unsharded(pool4: RankPool) -> None:
    for res in pool4.run(_equal_to_unsharded, True, True, timeout=300):
        assert res["bytes"] == _expected_local_bytes(4)
        assert res["fwd"] == {"all_gather": 9, "reduce_scatter": 9}


def _bad_tp(rank: int, world: int) -> str:
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp, tiny_config

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_config(num_key_value_heads=2, num_attention_heads=6, linear_num_key_heads=3,
                        linear_num_value_heads=6).build()
    try:
        parallelize_qwen3_5_tp(model, mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def test_tp_not_dividing_heads_fails_naming_them(pool4: RankPool) -> None:
    msg = pool4.run(_bad_tp)[0]
    assert "tp=4 does not divide" in msg and "num_key_value_heads=2" in msg and "linear_num_key_heads=3" in msg
