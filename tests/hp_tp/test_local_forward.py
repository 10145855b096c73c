# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Styled Linear and Embedding layers run as hand-written tensor-parallel code: the same values
and gradients as one process (float64), the planned collectives only -- one input gather or
gradient reduction shared by the projections of one input, no more than torch's styles -- no
DTensor op dispatch for the matmuls or lookups, and parameters that stay the same DTensors."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)


class _Counting:
    """Counts the aten ops that go through DTensor dispatch."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def __enter__(self) -> _Counting:
        from hp_dtensor.platform.torch import dtensor as mod

        self._orig = mod.DTensor.__dict__["__torch_dispatch__"]
        orig = self._orig.__func__
        ops = self.ops

        def counting(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            ops.append(str(func))
            return orig(cls, func, types, args, kwargs)

        mod.DTensor.__torch_dispatch__ = classmethod(counting)
        return self

    def __exit__(self, *exc: Any) -> None:
        from hp_dtensor.platform.torch import dtensor as mod

        mod.DTensor.__torch_dispatch__ = self._orig


def _swiglu(rank: int, world: int, sp: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    from hp_dtensor import CommDebugMode, Shard, init_device_mesh
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(16, 32, bias=False, dtype=torch.float64)
            self.up_proj = nn.Linear(16, 32, bias=True, dtype=torch.float64)
            self.down_proj = nn.Linear(32, 16, bias=False, dtype=torch.float64)

        def forward(self, x: Any) -> Any:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    ref = SwiGLU()
    mesh = init_device_mesh("cpu", (world,))
    col = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "gate_proj": col, "up_proj": copy.copy(col),
        "down_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()})
    params_before = [id(p) for p in model.parameters()]
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    xl = (x.chunk(world, 1)[rank] if sp else x).clone().requires_grad_(True)
    with CommDebugMode() as fwd, _Counting() as fwd_ops:
        y = model(xl)
    with CommDebugMode() as bwd, _Counting() as bwd_ops:
        y.sum().backward()
    out = ref(xr)
    out.sum().backward()
    torch.testing.assert_close(y, out.chunk(world, 1)[rank] if sp else out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xl.grad, xr.grad.chunk(world, 1)[rank] if sp else xr.grad, rtol=1e-12, atol=1e-12)
    placements = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=1e-12)
        placements[name] = (p.placements == p.grad.placements, type(p).__name__)
    return {"fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts(), "fwd_ops": fwd_ops.ops,
            "bwd_ops": bwd_ops.ops, "same_params": params_before == [id(p) for p in model.parameters()],
            "placements": placements}


def _torch_counts(rank: int, world: int) -> dict[str, Any]:
    """torch.distributed.tensor.parallel on the same MLP, for the count comparison."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = nn.ModuleDict({"gate_proj": nn.Linear(16, 32), "up_proj": nn.Linear(16, 32), "down_proj": nn.Linear(32, 16)})
    parallelize_module(m, init_device_mesh("cpu", (world,)),
                       {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    x = torch.randn(2, 4, 16, requires_grad=True)
    with CommDebugMode() as fwd:
        y = m["down_proj"](nn.functional.silu(m["gate_proj"](x)) * m["up_proj"](x))
    with CommDebugMode() as bwd:
        y.sum().backward()
    return {"fwd": sum(fwd.get_comm_counts().values()), "bwd": sum(bwd.get_comm_counts().values())}


@pytest.mark.parametrize("sp", [False, True], ids=["replicated_input", "sequence_sharded_input"])
def test_mlp_is_hand_written_code(pool2: RankPool, sp: bool) -> None:
    theirs = pool2.run(_torch_counts)[0]
    for res in pool2.run(_swiglu, sp):
        if sp:
            # one all_gather of the input for gate and up; one reduce_scatter out of down_proj
            assert res["fwd"] == {"all_gather": 1, "reduce_scatter": 1}
            assert res["bwd"] == {"all_gather": 1, "reduce_scatter": 1}
        else:
            # as a Megatron MLP: one all_reduce each way (torch's styles reduce the input
            # gradient once per projection)
            assert res["fwd"] == {"all_reduce": 1} and res["bwd"] == {"all_reduce": 1}
            assert sum(res["fwd"].values()) <= theirs["fwd"] and sum(res["bwd"].values()) <= theirs["bwd"]
        # the matmuls run on local tensors: DTensor dispatch sees no mm/addmm/linear either way
        assert not [op for op in res["fwd_ops"] + res["bwd_ops"] if "mm" in op or "linear" in op], res
        assert res["fwd_ops"] == [] or all("silu" in o or "mul" in o for o in res["fwd_ops"]), res["fwd_ops"]
        assert res["same_params"]
        assert all(same and kind == "DTensor" for same, kind in res["placements"].values()), res["placements"]


def _embeddings(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, style, pad in [("rowwise", RowwiseParallel(), 5), ("rowwise_pad_first", RowwiseParallel(), 0),
                             ("colwise", ColwiseParallel(), 3)]:
        torch.manual_seed(1)
        ref = nn.Embedding(16, 8, padding_idx=pad, dtype=torch.float64)
        model = parallelize_module(copy.deepcopy(ref), mesh, style)
        ids = torch.tensor([[0, 7, 8, 15], [5, 3, 8, 9]])  # both sides of the shard boundary, the padding id
        with CommDebugMode() as fwd:
            y = model(ids)
        g = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        yl = y if name.startswith("rowwise") else y
        (yl * (g if name.startswith("rowwise") else g.chunk(world, -1)[rank])).sum().backward()
        r = ref(ids)
        (r * g).sum().backward()
        torch.testing.assert_close(y, r if name.startswith("rowwise") else r.chunk(world, -1)[rank])
        torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad)
        try:
            model(torch.tensor([[1, 16]]))
            bad = "no error"
        except IndexError as e:
            bad = str(e)
        out[name] = {"fwd": fwd.get_comm_counts(), "bad": bad}
    return out


def test_embeddings_match_and_fail_on_bad_ids(pool2: RankPool) -> None:
    for res in pool2.run(_embeddings):
        assert res["rowwise"]["fwd"] == {"all_reduce": 1} and res["colwise"]["fwd"] == {}
        for case in res.values():
            assert case["bad"].startswith("index out of range"), case


def _norms(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from hp_dtensor import CommDebugMode, Partial, init_device_mesh
    from hp_tp import SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, ref, seq_dim in [("layernorm", nn.LayerNorm(8, dtype=torch.float64), 1),
                               ("rmsnorm", nn.RMSNorm(8, dtype=torch.float64), 1),
                               ("layernorm_on_normalized_dim", nn.LayerNorm(8, dtype=torch.float64), 2)]:
        torch.manual_seed(3)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p))
        model = parallelize_module(copy.deepcopy(ref), mesh, SequenceParallel(sequence_dim=seq_dim))
        x = torch.randn(2, 4, 8, dtype=torch.float64)
        xr = x.clone().requires_grad_(True)
        xl = x.chunk(world, seq_dim)[rank].clone().requires_grad_(True)
        with CommDebugMode() as fwd, _Counting() as ops:
            y = model(xl)
        g = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        (y.full_tensor() * g).sum().backward()
        r = ref(xr)
        (r * g).sum().backward()
        torch.testing.assert_close(y.full_tensor(), r)
        torch.testing.assert_close(xl.grad, xr.grad.chunk(world, seq_dim)[rank])
        partial = True
        for (pn, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=pn)
            partial = partial and p.grad.placements == (Partial(),)
        out[name] = {"fwd": fwd.get_comm_counts(), "ops": len(ops.ops), "partial_grads": partial}
    return out


def test_sequence_parallel_norms_run_locally(pool2: RankPool) -> None:
    for res in pool2.run(_norms):
        for name in ("layernorm", "rmsnorm"):
            assert res[name] == {"fwd": {}, "ops": 0, "partial_grads": True}, (name, res[name])
        # sharding the normalized dim is not token-wise: the DTensor forward runs (and is right)
        assert res["layernorm_on_normalized_dim"]["ops"] > 0
