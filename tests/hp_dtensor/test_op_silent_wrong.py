# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Regression tests for the ops that gave silently wrong answers (issue 11, classes 1-4 and 6),
each against plain float64 tensors on one process, on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2)


def _setup(world: int) -> tuple[Any, Any, Any]:
    import torch

    from hp_dtensor import init_device_mesh
    from hp_dtensor.platform.torch import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)

    def rn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def d(t: Any, *pl: Any) -> Any:
        return distribute_tensor(t, mesh, list(pl), src_data_rank=None)

    return mesh, rn, d


def _constants_on_partial(rank: int, world: int) -> list[str]:
    """Class 1: a constant added to a Partial(sum) must be added once, not once per rank; a cast
    to an integer does not commute with the sum."""
    import torch

    from hp_dtensor import DTensor, Partial, Shard

    mesh, rn, d = _setup(world)
    x, w = rn(4, 8), rn(8, 6)
    y = d(x, Shard(1)) @ d(w, Shard(0))
    assert y.placements == (Partial("sum"),)
    ref = x @ w
    bad = []
    checks = {
        "y + 1e-3": (y + 1e-3, ref + 1e-3),
        "y - 2": (y - 2, ref - 2),
        "1 - y": (1 - y, 1 - ref),
        "y + 0-d tensor": (y + torch.tensor(0.5, dtype=torch.float64), ref + 0.5),
        "0-d tensor - y": (torch.tensor(0.5, dtype=torch.float64) - y, 0.5 - ref),
        "2 / y": (2 / y, 2 / ref),
        "(y * 10).to(int32)": ((y * 10).to(torch.int32), (ref * 10).to(torch.int32)),
        "y.masked_fill(mask, 3)": (y.masked_fill(d(ref > 0, Shard(0)), 3.0), ref.masked_fill(ref > 0, 3.0)),
    }
    avg = DTensor.from_local(x * (rank + 1), mesh, [Partial("avg")])
    mean_scale = sum(range(1, world + 1)) / world
    checks["Partial(avg) + 1"] = (avg + 1, x * mean_scale + 1)
    y2 = y.clone()
    y2.add_(0.25)
    checks["y.add_(0.25)"] = (y2, ref + 0.25)
    for name, (got, want) in checks.items():
        full = got.full_tensor()
        if full.dtype != want.dtype or not torch.allclose(full.double(), want.double(), rtol=1e-9, atol=1e-9):
            bad.append(f"{name}: max err {(full.double() - want.double()).abs().max()}")
    return bad


def test_constants_on_partial_added_once(pool2: RankPool) -> None:
    for bad in pool2.run(_constants_on_partial):
        assert not bad, bad


def _cache_keys(rank: int, world: int) -> list[str]:
    """Class 2: the decision cache must tell (0, 1) from 0, True, and 1 from True and 1.0."""
    import torch

    from hp_dtensor import Shard

    mesh, rn, d = _setup(world)
    x = rn(4, 8)
    bad = []
    for pl in (Shard(0), Shard(1)):
        dx = d(x, pl)
        seq = [
            (lambda t: t.sum(dim=(0, 1)), lambda t: t.sum(0, keepdim=True)),
            (lambda t: t.mean((0, 1)), lambda t: t.mean(0, True)),
            (lambda t: t.amax((0, 1)), lambda t: t.amax(0, True)),
            (lambda t: t.sum(1), lambda t: t.sum(1, keepdim=True)),
        ]
        for first, second in seq:
            first(dx)
            got = second(dx).full_tensor()
            want = second(x)
            if got.shape != want.shape or not torch.allclose(got, want):
                bad.append(f"{pl}: got shape {tuple(got.shape)}, want {tuple(want.shape)}")
        y1 = (dx * 1).full_tensor()
        y2 = (dx * 1.5).full_tensor()
        y3 = (dx * True).full_tensor()
        if not (torch.equal(y1, x) and torch.allclose(y2, x * 1.5) and torch.equal(y3, x)):
            bad.append(f"{pl}: scalar 1 / 1.5 / True collide")
    return bad


def test_cache_key_is_structural_and_type_exact(pool2: RankPool) -> None:
    for bad in pool2.run(_cache_keys):
        assert not bad, bad


def _strides_and_views(rank: int, world: int) -> list[str]:
    """Class 3: the wrapper reports the strides the plain tensor would have, and views, reshapes
    and attention on strided shards give the plain tensor's values."""
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Replicate, Shard

    mesh, rn, d = _setup(world)
    bad = []
    logits, w, x = rn(2, 6, 8), rn(8, 6), rn(4, 8)
    cases = {
        "logits[:, :-1].flatten(0, 1)": (lambda t: t[:, :-1].flatten(0, 1), logits, Shard(2)),
        "w.t().reshape(-1)": (lambda t: t.t().reshape(-1), w, Shard(0)),
        "w.t().reshape(-1) (dim-1 shard)": (lambda t: t.t().reshape(-1), w, Shard(1)),
        "x.transpose(0, 1).contiguous().view(-1)": (lambda t: t.transpose(0, 1).contiguous().view(-1), x, Shard(0)),
        "x.t() strides": (lambda t: t.t(), x, Shard(1)),
        "gathered last dim": (lambda t: t.redistribute(mesh, [Replicate()]).transpose(0, 1), x, Shard(1)),
    }
    for name, (fn, t, pl) in cases.items():
        got = fn(d(t, pl))
        want = fn(t) if name != "gathered last dim" else t.transpose(0, 1)
        if not torch.equal(got.full_tensor(), want):
            bad.append(f"{name}: values differ")
        if name.endswith("strides") and got.stride() != want.stride():
            bad.append(f"{name}: strides {got.stride()} vs plain {want.stride()}")
    q, k, v = rn(2, 4, 8, 4), rn(2, 4, 8, 4), rn(2, 4, 8, 4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for pls in ((Shard(1), Shard(3), Replicate()), (Shard(3), Shard(3), Shard(3)), (Shard(1), Shard(3), Shard(2))):
        got = F.scaled_dot_product_attention(d(q, pls[0]), d(k, pls[1]), d(v, pls[2]), is_causal=True)
        if not torch.allclose(got.full_tensor(), want, rtol=1e-9, atol=1e-9):
            bad.append(f"sdpa {pls}: max err {(got.full_tensor() - want).abs().max()}")
    return bad


def test_strides_views_and_attention_on_strided_shards(pool2: RankPool) -> None:
    for bad in pool2.run(_strides_and_views):
        assert not bad, bad


def _python_values(rank: int, world: int) -> list[Any]:
    """Class 4: equal/allclose/item/bool/is_nonzero give the global answer on every rank."""
    import torch

    from hp_dtensor import DTensor, Shard

    mesh, rn, d = _setup(world)
    x = rn(4, 8)
    y = x.clone()
    if rank == 1:  # only rank 1's shard differs: the tensors differ, every rank must say so
        y[-1, -1] += 1
    dx = d(x, Shard(0))
    dy = DTensor.from_local(y.chunk(world, 0)[rank], mesh, [Shard(0)])
    return [
        torch.equal(dx, dy),
        torch.allclose(dx, dy),
        torch.equal(dx, d(x, Shard(0))),
        torch.equal(dx, d(x[:2], Shard(0))),
        dx.sum().item(),
        bool(dx.sum() > 1e9),
        dx.amax().is_nonzero(),
    ]


def test_python_values_are_global_on_every_rank(pool2: RankPool) -> None:
    import torch

    res = pool2.run(_python_values)
    assert res[0] == res[1], res
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert res[0][:4] == [False, False, True, False]
    assert abs(res[0][4] - x.sum().item()) < 1e-9
    assert res[0][5:] == [False, True]


def _nan(rank: int, world: int) -> list[str]:
    """Class 6: NaN anywhere in a max/min over a sharded dim gives NaN everywhere."""
    import torch

    from hp_dtensor import Shard

    mesh, rn, d = _setup(world)
    x = rn(4, 8)
    x[3, 1] = float("nan")  # in rank 1's rows of Shard(0), rank 0's columns of Shard(1)
    bad = []
    fns = {
        "amax(0)": lambda t: t.amax(0), "amin(0)": lambda t: t.amin(0), "max()": lambda t: t.max(),
        "min()": lambda t: t.min(), "amax(1)": lambda t: t.amax(1), "max(0).values": lambda t: t.max(0).values,
        "norm": lambda t: torch.linalg.vector_norm(t), "sum(0)": lambda t: t.sum(0),
    }
    for pl in (Shard(0), Shard(1)):
        for name, fn in fns.items():
            got, want = fn(d(x, pl)).full_tensor(), fn(x)
            if not torch.equal(got.isnan(), want.isnan()):
                bad.append(f"{name} on {pl}: NaN at {got.isnan().nonzero().tolist()}, want {want.isnan().nonzero().tolist()}")
    return bad


def test_nan_propagates_through_max_min_over_shards(pool2: RankPool) -> None:
    for bad in pool2.run(_nan):
        assert not bad, bad


def _module_conversions(rank: int, world: int) -> list[str]:
    import torch
    from torch import nn

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    bad = []
    for meta in (False, True):
        torch.manual_seed(0)
        full = torch.randn(4, 3)
        lin = nn.Linear(3, 4, device="meta" if meta else "cpu")
        lin.weight = nn.Parameter(distribute_tensor(full.to(lin.weight.device), mesh, [Shard(0)]))
        if meta:
            lin.to_empty(device="cpu")
            with torch.no_grad():
                lin.weight.to_local().copy_(full.chunk(world)[rank])
        lin.double()
        w = lin.weight
        if w.dtype != torch.float64 or w.to_local().dtype != torch.float64:
            bad.append(f"meta={meta}: wrapper {w.dtype}, local {w.to_local().dtype}")
        elif not torch.equal(w.full_tensor(), full.double()):
            bad.append(f"meta={meta}: values changed")
    return bad


def test_module_dtype_conversion_converts_the_local_shard(pool2: RankPool) -> None:
    """``module.double()`` (and ``to_empty``) on DTensor parameters once changed the wrapper's dtype
    but not its local shard."""
    assert pool2.run(_module_conversions) == [[], []]
