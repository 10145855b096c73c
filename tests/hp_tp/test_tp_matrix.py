# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Test-matrix rows B1-B9, C1-C14, D1-D5 (docs/tensor-parallel.md) on real gloo ranks (2 and 4), against
single-process references with the same weights, plus the exact collective counts of every style.

Gradient comparisons: every gradient is compared directly with the single-device one.  No Rowwise
weight gradient is divided by tp_size (a suite that all-reduces in the backward of the forward
all-reduce would need that); here that dual is the identity (as in Megatron and
torch.distributed.tensor), so gradients already equal the single-device ones.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2)
pool4 = rank_pool_fixture(4)

RTOL, ATOL = 1.5e-4, 1e-5


def _mesh(world: int) -> Any:
    from hp_dtensor import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _close(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    import torch

    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _chunk(t: Any, dim: int, rank: int, world: int) -> Any:
    return t.chunk(world, dim=dim)[rank].contiguous()


def _gather_last(t: Any, world: int) -> Any:
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check_grads(model: Any, ref: Any) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        _close(_full(p.grad), q.grad)


# ---------------------------------------------------------------- B: geometry
def _geometry(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from hp_tp import ColwiseParallel, NoParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = _mesh(world)
    out: dict[str, Any] = {}
    for key, module, style in [
        ("B1", nn.Linear(32, 64), ColwiseParallel()),
        ("B2", nn.Linear(32, 24), RowwiseParallel()),
        ("B3", nn.Embedding(16, 8), ColwiseParallel()),
        ("B4", nn.Embedding(16, 8), RowwiseParallel()),
        ("B5", nn.LayerNorm(8), SequenceParallel()),
        ("B6", nn.Linear(8, 6), NoParallel()),
    ]:
        parallelize_module(module, mesh, style)
        out[key] = {
            n: (type(p).__name__, p.placements, tuple(p.to_local().shape)) for n, p in module.named_parameters()
        }
    del torch
    return out


def _src_data_rank(rank: int, world: int, src: Any, meta: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    from hp_dtensor import CommDebugMode
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    if meta:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    else:
        model = copy.deepcopy(ref)
        if src == 0 and rank != 0:  # B7: only rank 0 holds the real weights
            for p in model.parameters():
                p.data.zero_()
    with CommDebugMode() as comm:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()}, src_data_rank=src)
    res: dict[str, Any] = {"comm": comm.get_comm_counts()}
    if meta:
        res["meta"] = [(p.to_local().is_meta, tuple(p.to_local().shape)) for p in model.parameters()]
    else:
        res["ok"] = all(
            torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), ref.parameters())
        )
    return res


def test_B1_to_B6_parameter_placements_and_local_shapes(pool2: RankPool) -> None:
    from hp_dtensor import Replicate, Shard

    for res in pool2.run(_geometry):
        assert res["B1"] == {"weight": ("DTensor", (Shard(0),), (32, 32)), "bias": ("DTensor", (Shard(0),), (32,))}
        assert res["B2"] == {"weight": ("DTensor", (Shard(1),), (24, 16)), "bias": ("DTensor", (Replicate(),), (24,))}
        assert res["B3"] == {"weight": ("DTensor", (Shard(1),), (16, 4))}
        assert res["B4"] == {"weight": ("DTensor", (Shard(0),), (8, 8))}
        assert res["B5"] == {"weight": ("DTensor", (Replicate(),), (8,)), "bias": ("DTensor", (Replicate(),), (8,))}
        assert res["B6"] == {"weight": ("DTensor", (Replicate(),), (6, 8)), "bias": ("DTensor", (Replicate(),), (6,))}


def test_B7_src_data_rank_0_takes_rank0_weights(pool2: RankPool) -> None:
    for res in pool2.run(_src_data_rank, 0, False):
        assert res["ok"]
        assert res["comm"] == {"scatter": 3, "broadcast": 1}  # col weight+bias, row weight; row bias


def test_B8_src_data_rank_none_slices_locally_without_comm(pool2: RankPool) -> None:
    for res in pool2.run(_src_data_rank, None, False):
        assert res["ok"] and res["comm"] == {}


def test_B9_meta_parameters_never_communicate(pool2: RankPool) -> None:
    for res in pool2.run(_src_data_rank, 0, True):
        assert res["comm"] == {}
        assert res["meta"] == [(True, (8, 8)), (True, (8,)), (True, (8, 8)), (True, (8,))]


# ---------------------------------------------------------------- C: numerics
def _C1_colwise(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import ColwiseParallel, parallelize_module

    torch.manual_seed(1)
    ref = nn.Linear(32, 64)
    model = parallelize_module(copy.deepcopy(ref), _mesh(world), ColwiseParallel())
    x = torch.randn(4, 32)
    g = torch.randn(4, 64)
    xr, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = ref(xr)
    y = model(xd)  # local Shard(-1)
    _close(_gather_last(y, world), y_ref)
    (y_ref * g).sum().backward()
    (y * _chunk(g, -1, rank, world)).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, xr.grad)
    return True


def _C2_rowwise(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import RowwiseParallel, parallelize_module

    torch.manual_seed(2)
    ref = nn.Linear(32, 24)
    model = parallelize_module(copy.deepcopy(ref), _mesh(world), RowwiseParallel())
    x = torch.randn(4, 32)
    g = torch.randn(4, 24)
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, -1, rank, world).requires_grad_(True)
    y_ref = ref(xr)
    y = model(xd)  # local, Replicate
    _close(y, y_ref)
    (y_ref * g).sum().backward()
    (y * g).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, _chunk(xr.grad, -1, rank, world))
    return True


def _mlp(hidden: int = 16, ffn: int = 32) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(hidden, ffn), nn.ReLU(), nn.Linear(ffn, hidden))


def _C3_mlp(rank: int, world: int) -> bool:
    import torch

    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(3)
    ref = _mlp()
    model = parallelize_module(copy.deepcopy(ref), _mesh(world), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 4, 16)
    g = torch.randn(2, 4, 16)
    xr, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref, y = ref(xr), model(xd)
    _close(y, y_ref)
    (y_ref * g).sum().backward()
    (y * g).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, xr.grad)
    return True


def _C4_C5_embedding(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(4)
    ids = torch.randint(0, 16, (2, 5))
    for style, gather in ((ColwiseParallel(), True), (RowwiseParallel(), False)):
        ref = nn.Embedding(16, 8)
        model = parallelize_module(copy.deepcopy(ref), _mesh(world), style)
        y = model(ids)
        y_ref = ref(ids)
        _close(_gather_last(y, world) if gather else y, y_ref)
        g = torch.randn(2, 5, 8)
        (y_ref * g).sum().backward()
        (y * (_chunk(g, -1, rank, world) if gather else g)).sum().backward()
        _check_grads(model, ref)
    return True


def _C6_sequence_layernorm(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import SequenceParallel, parallelize_module

    torch.manual_seed(6)
    ref = nn.LayerNorm(16)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    model = parallelize_module(copy.deepcopy(ref), _mesh(world), SequenceParallel())
    x = torch.randn(2, 8, 16)
    g = torch.randn(2, 8, 16)
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 1, rank, world).requires_grad_(True)
    y_ref, y = ref(xr), model(xd)
    assert type(y).__name__ == "DTensor"
    _close(y.to_local(), _chunk(y_ref, 1, rank, world))
    _close(y.full_tensor(), y_ref)
    (y_ref * g).sum().backward()
    (y.to_local() * _chunk(g, 1, rank, world)).sum().backward()
    from hp_dtensor import Partial

    assert model.weight.grad.placements == (Partial(),)
    _check_grads(model, ref)
    _close(xd.grad, _chunk(xr.grad, 1, rank, world))
    return True


def _C7_C8_C9(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import NoParallel, SequenceParallel, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(7)
    # C7: dropout(p=0) under sequence parallel is the identity
    drop = parallelize_module(nn.Dropout(0.0), mesh, SequenceParallel())
    x = torch.randn(2, 8, 16)
    _close(drop(_chunk(x, 1, rank, world)).full_tensor(), x)
    # C7 with p > 0: each rank's mask is its slice of the one-process mask (same seed), and the
    # gradient is masked the same way
    drop = parallelize_module(nn.Dropout(0.5), mesh, SequenceParallel())
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 1, rank, world).requires_grad_(True)
    g = torch.randn(2, 8, 16)
    torch.manual_seed(70)
    y = drop(xd)
    torch.manual_seed(70)
    y_ref = nn.functional.dropout(xr, 0.5, True)
    assert torch.equal(y.full_tensor(), y_ref) and 0 < int((y_ref == 0).sum()) < y_ref.numel()
    (y_ref * g).sum().backward()
    (y.to_local() * _chunk(g, 1, rank, world)).sum().backward()
    assert torch.equal(xd.grad, _chunk(xr.grad, 1, rank, world))
    # C8: NoParallel Linear gives the single-device output on every rank
    ref = nn.Linear(16, 8)
    lin = parallelize_module(copy.deepcopy(ref), mesh, NoParallel())
    _close(lin(x), ref(x))
    # C9: sequence-sharded activations from SP gathered into the replicated module
    ref_seq = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8))
    seq = parallelize_module(copy.deepcopy(ref_seq), mesh, {"0": SequenceParallel(), "1": NoParallel()})
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 1, rank, world).requires_grad_(True)
    y_ref, y = ref_seq(xr), seq(xd)
    _close(y, y_ref)
    y_ref.sum().backward()
    y.sum().backward()
    _check_grads(seq, ref_seq)
    _close(xd.grad, _chunk(xr.grad, 1, rank, world))
    return True


def _C10_C11(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_dtensor import Replicate, Shard
    from hp_tp import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh(world)
    torch.manual_seed(10)
    # C10: batch-sharded input prepared to Replicate, then column-parallel
    ref = nn.Sequential(nn.Linear(16, 32))
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=False)})
    parallelize_module(model, mesh, PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()))
    x = torch.randn(8, 16)
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 0, rank, world).requires_grad_(True)
    y_ref, y = ref(xr), model(xd)
    _close(y.full_tensor(), y_ref)
    (y_ref ** 2).sum().backward()
    (y.full_tensor() ** 2).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, _chunk(xr.grad, 0, rank, world))
    # C11: row-parallel output re-laid out by PrepareModuleOutput
    ref2 = nn.Sequential(nn.Linear(16, 8))
    model2 = copy.deepcopy(ref2)
    parallelize_module(model2, mesh, {"0": RowwiseParallel(use_local_output=False)})
    parallelize_module(model2, mesh, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    y2 = model2(_chunk(x, -1, rank, world))
    _close(y2, _chunk(ref2(x), 0, rank, world))
    return True


def _C12_prepare_input_output_block(rank: int, world: int) -> bool:
    import torch

    from hp_dtensor import Replicate, Shard
    from hp_tp import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(12)
    ref = _mlp()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})
    parallelize_module(model, mesh, PrepareModuleInputOutput(
        input_layouts=Shard(1), desired_input_layouts=Replicate(),
        output_layouts=Replicate(), desired_output_layouts=Shard(1),
    ))
    x = torch.randn(2, 8, 16)
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 1, rank, world).requires_grad_(True)
    y_ref, y = ref(xr), model(xd)
    _close(y, _chunk(y_ref, 1, rank, world))
    g = torch.randn(2, 8, 16)
    (y_ref * g).sum().backward()
    (y * _chunk(g, 1, rank, world)).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, _chunk(xr.grad, 1, rank, world))
    return True


def _C13_reduce_dtype(rank: int, world: int, dtype_name: str) -> tuple[float, float]:
    import torch
    from torch import nn

    from hp_tp import RowwiseParallel, parallelize_module

    mesh = _mesh(world)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(13)
    ref = nn.Linear(512, 64)
    x = torch.randn(16, 512)
    y_ref = ref(x)  # fp32 reference
    errs = []
    for reduce_dtype in (torch.float32, None):
        model = parallelize_module(copy.deepcopy(ref).to(dtype), mesh, RowwiseParallel(reduce_dtype=reduce_dtype))
        y = model(_chunk(x, -1, rank, world).to(dtype))
        if reduce_dtype is not None:
            assert y.dtype == torch.float32
            torch.testing.assert_close(y, y_ref, rtol=1e-3 * 30, atol=1e-3 * 30)
        errs.append((y.float() - y_ref).abs().sum().item())
    return errs[0], errs[1]


def _C14_sequence_dim_2(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import SequenceParallel, parallelize_module

    torch.manual_seed(14)
    ref = nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    model = parallelize_module(copy.deepcopy(ref), _mesh(world), SequenceParallel(sequence_dim=2, use_local_output=True))
    x = torch.randn(2, 4, 8, 8)  # (B, H, S, D), sequence on dim 2
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 2, rank, world).requires_grad_(True)
    y_ref, y = ref(xr), model(xd)
    _close(y, _chunk(y_ref, 2, rank, world))
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    (y * _chunk(g, 2, rank, world)).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, _chunk(xr.grad, 2, rank, world))
    return True


@pytest.mark.parametrize(
    "case", [_C1_colwise, _C2_rowwise, _C3_mlp, _C4_C5_embedding, _C6_sequence_layernorm, _C7_C8_C9, _C10_C11,
             _C14_sequence_dim_2],
    ids=["C1", "C2", "C3", "C4_C5", "C6", "C7_C8_C9", "C10_C11", "C14"],
)
def test_C_numerics_2_ranks(pool2: RankPool, case: Any) -> None:
    assert pool2.run(case) == [True, True]


@pytest.mark.parametrize("case", [_C6_sequence_layernorm, _C10_C11, _C12_prepare_input_output_block],
                         ids=["C6", "C10", "C12"])
def test_C_numerics_4_ranks(pool4: RankPool, case: Any) -> None:
    assert pool4.run(case) == [True] * 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_C13_fp32_reduce_is_closer_to_fp32_reference(pool4: RankPool, dtype: str) -> None:
    for promoted, plain in pool4.run(_C13_reduce_dtype, dtype):
        assert promoted < plain, (promoted, plain)


# ---------------------------------------------------------------- D: compositions
class _Layers:
    @staticmethod
    def build(n: int = 4) -> Any:
        from torch import nn

        class MLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate_proj = nn.Linear(8, 16)
                self.up_proj = nn.Linear(8, 16)
                self.down_proj = nn.Linear(16, 8)

        class Layer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.mlp = MLP()

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = nn.ModuleList(Layer() for _ in range(n))

        return Model()


def _D1_glob(rank: int, world: int) -> dict[str, Any]:
    from hp_dtensor import CommDebugMode
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _Layers.build()
    with CommDebugMode() as comm:
        parallelize_module(model, _mesh(world), {
            "layers.*.mlp.gate_proj": ColwiseParallel(),
            "layers.[1-2].mlp.up_proj": ColwiseParallel(),
            "layers.?.mlp.down_proj": RowwiseParallel(),
        }, src_data_rank=None)
    model2 = _Layers.build()
    parallelize_module(model2, _mesh(world), {"*.*.mlp.*_proj": ColwiseParallel()}, src_data_rank=None)
    sharded = sorted(n for n, p in model.named_parameters() if hasattr(p, "placements") and n.endswith("weight"))
    sharded2 = sum(1 for _, p in model2.named_parameters() if hasattr(p, "placements"))
    return {"sharded": sharded, "multi": sharded2, "comm": comm.get_total_counts()}


def _D2_single_style_root(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import ColwiseParallel, parallelize_module

    torch.manual_seed(22)
    ref = nn.Linear(8, 8)
    model = parallelize_module(copy.deepcopy(ref), _mesh(world), ColwiseParallel(output_layouts=_replicate()))
    x = torch.randn(3, 8)
    _close(model(x), ref(x))
    return True


def _replicate() -> Any:
    from hp_dtensor import Replicate

    return Replicate()


def _qwen_block() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, hidden: int = 16, heads: int = 4) -> None:
            super().__init__()
            self.head_dim = hidden // heads
            self.q_proj = nn.Linear(hidden, hidden, bias=False)
            self.k_proj = nn.Linear(hidden, hidden, bias=False)
            self.v_proj = nn.Linear(hidden, hidden, bias=False)
            self.o_proj = nn.Linear(hidden, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.RMSNorm(16)
            self.self_attn = Attention()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.self_attn(self.input_layernorm(x))

    return Block()


def _qwen_plan() -> dict[str, Any]:
    from hp_dtensor import Replicate, Shard
    from hp_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _D3_qwen_block(rank: int, world: int) -> dict[str, Any]:
    import torch

    from hp_dtensor import CommDebugMode, Shard
    from hp_tp import PrepareModuleInput, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(33)
    ref = _qwen_block()
    with torch.no_grad():
        ref.input_layernorm.weight.normal_()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, _qwen_plan())
    parallelize_module(model, mesh, PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1)))
    x = torch.randn(2, 8, 16)
    xr = x.clone().requires_grad_(True)
    xd = _chunk(x, 1, rank, world).requires_grad_(True)
    with CommDebugMode() as fwd:
        y = model(xd)
    y_ref = ref(xr)
    assert y.placements == (Shard(1),)
    _close(y.full_tensor(), y_ref)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    with CommDebugMode() as bwd:
        (y.to_local() * _chunk(g, 1, rank, world)).sum().backward()
    _check_grads(model, ref)
    _close(xd.grad, _chunk(xr.grad, 1, rank, world))
    return {"fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts()}


def _D4_lm_head_loss_parallel(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from hp_dtensor import CommDebugMode, Shard
    from hp_tp import ColwiseParallel, loss_parallel, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(44)
    ref = nn.Linear(16, 32, bias=False)  # vocab 32
    model = parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False))
    h = torch.randn(2, 8, 16)
    target = torch.randint(0, 32, (2, 8))
    target[0, 0] = -100  # ignored token
    hr = h.clone().requires_grad_(True)
    hd = _chunk(h, 1, rank, world).requires_grad_(True)
    loss_ref = F.cross_entropy(ref(hr).flatten(0, 1), target.flatten())
    with CommDebugMode() as comm:
        logits = model(hd)
        assert logits.placements == (Shard(2),) and logits.to_local().shape[-1] == 32 // world
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss.backward()
    loss_ref.backward()
    _close(loss.full_tensor(), loss_ref)
    _check_grads(model, ref)
    _close(hd.grad, _chunk(hr.grad, 1, rank, world))
    bytes_gathered = comm.get_comm_bytes().get("all_gather", 0)
    return {"comm": comm.get_comm_counts(), "gathered": bytes_gathered}


def _D5_no_parallel_norm(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import ColwiseParallel, NoParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(55)
    ref = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
    model = copy.deepcopy(ref)
    parallelize_module(model, _mesh(world), {"0": NoParallel(use_local_output=False), "1": ColwiseParallel(),
                                             "3": RowwiseParallel()})
    x = torch.randn(2, 4, 16)
    _close(model(x), ref(x))
    ref(x).sum().backward()
    model(x).sum().backward()
    _check_grads(model, ref)
    return True


def test_D1_glob_matching(pool2: RankPool) -> None:
    for res in pool2.run(_D1_glob):
        assert res["comm"] == 0  # src_data_rank=None
        expect = [f"layers.{i}.mlp.gate_proj.weight" for i in range(4)]
        expect += [f"layers.{i}.mlp.up_proj.weight" for i in (1, 2)]
        expect += [f"layers.{i}.mlp.down_proj.weight" for i in range(4)]
        assert res["sharded"] == sorted(expect)
        assert res["multi"] == 4 * 3 * 2  # every weight and bias of every *_proj


def test_D2_single_style_on_root(pool2: RankPool) -> None:
    assert pool2.run(_D2_single_style_root) == [True, True]


@pytest.mark.parametrize("world", [2, 4])
def test_D3_qwen_block(pool2: RankPool, pool4: RankPool, world: int) -> None:
    pool = pool2 if world == 2 else pool4
    for res in pool.run(_D3_qwen_block):
        # attn entry all_gather, o_proj reduce_scatter; and their duals in backward (the norm
        # weight's gradient stays Partial until the optimizer step reduces it)
        assert res["fwd"] == {"all_gather": 1, "reduce_scatter": 1}
        assert res["bwd"] == {"reduce_scatter": 1, "all_gather": 1}


def test_D4_lm_head_with_loss_parallel(pool2: RankPool) -> None:
    for res in pool2.run(_D4_lm_head_loss_parallel):
        # one all_gather (the sequence-sharded hidden states, 2*8*16 fp32), never the vocab dim
        assert res["comm"].get("all_gather") == 1 and res["gathered"] == 2 * 8 * 16 * 4


def test_D5_no_parallel_norm(pool2: RankPool) -> None:
    assert pool2.run(_D5_no_parallel_norm) == [True, True]


# ---------------------------------------------------------------- collective counts
def _counts(rank: int, world: int, which: str) -> dict[str, dict[str, int]]:
    import torch
    from torch import nn

    from hp_dtensor import CommDebugMode, Shard
    from hp_tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(0)
    x3 = torch.randn(2, 4, 16)
    if which == "colwise":
        m, x = parallelize_module(nn.Linear(16, 8), mesh, ColwiseParallel()), x3
    elif which == "colwise_shard0":
        m = parallelize_module(nn.Linear(16, 8), mesh, ColwiseParallel(input_layouts=Shard(0)))
        x = _chunk(x3, 0, rank, world)
    elif which == "rowwise":
        m, x = parallelize_module(nn.Linear(16, 8), mesh, RowwiseParallel()), _chunk(x3, -1, rank, world)
    elif which == "rowwise_shard0":
        m = parallelize_module(nn.Linear(16, 8), mesh, RowwiseParallel(output_layouts=Shard(0)))
        x = _chunk(x3, -1, rank, world)
    elif which in ("colwise_embedding", "rowwise_embedding"):
        style = ColwiseParallel() if which == "colwise_embedding" else RowwiseParallel()
        m, x = parallelize_module(nn.Embedding(16, 8), mesh, style), torch.randint(0, 16, (2, 4))
    elif which == "sequence":
        m, x = parallelize_module(nn.LayerNorm(16), mesh, SequenceParallel()), _chunk(x3, 1, rank, world)
    elif which == "mlp":
        m = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = x3
    else:  # mlp_sp
        m = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(input_layouts=Shard(1)),
                                              "2": RowwiseParallel(output_layouts=Shard(1))})
        x = _chunk(x3, 1, rank, world)
    if x.is_floating_point():
        x = x.clone().requires_grad_(True)
    with CommDebugMode() as fwd:
        y = m(x)
    loss = (y.to_local() if hasattr(y, "to_local") else y).sum()
    with CommDebugMode() as bwd:
        loss.backward()
    return {"fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts()}


@pytest.mark.parametrize(
    "which,fwd,bwd",
    [
        ("colwise", {}, {"all_reduce": 1}),
        ("colwise_shard0", {"all_gather": 1}, {"reduce_scatter": 1}),
        ("rowwise", {"all_reduce": 1}, {}),
        ("rowwise_shard0", {"reduce_scatter": 1}, {"all_gather": 1}),
        ("colwise_embedding", {}, {}),
        ("rowwise_embedding", {"all_reduce": 1}, {}),
        ("sequence", {}, None),
        ("mlp", {"all_reduce": 1}, {"all_reduce": 1}),
        ("mlp_sp", {"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 1, "reduce_scatter": 1}),
    ],
)
def test_collective_counts(pool2: RankPool, which: str, fwd: dict[str, int], bwd: dict[str, int] | None) -> None:
    for res in pool2.run(_counts, which):
        assert res["fwd"] == fwd, res
        if bwd is not None:
            assert res["bwd"] == bwd, res


def _untouched(rank: int, world: int) -> bool:
    import torch
    from torch import nn

    from hp_tp import ColwiseParallel, parallelize_module

    torch.manual_seed(9)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model = copy.deepcopy(ref)
    parallelize_module(model, _mesh(world), {"0": ColwiseParallel(output_layouts=_replicate())})
    assert type(model[1].weight) is nn.Parameter and not hasattr(model[1].weight, "placements")
    assert not model[1]._forward_pre_hooks and not model[1]._forward_hooks
    x = torch.randn(2, 8)
    _close(model(x), ref(x))
    return True


def test_modules_without_a_style_behave_as_before(pool2: RankPool) -> None:
    assert pool2.run(_untouched) == [True, True]
