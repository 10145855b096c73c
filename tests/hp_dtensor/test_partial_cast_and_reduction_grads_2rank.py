# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The torch backend on 2 gloo ranks, for the rules the MindSpore backend shares with it:

* a cast of a ``Partial`` to a narrower float (``.to(torch.float16)``, ``.half()``,
  ``.bfloat16()``, float64 -> ``.float()``) reduces first and equals the one-process cast of the
  reduced value bit for bit; a widening cast stays Partial (no collective).  torch.distributed.tensor
  casts each term instead (its error is printed, not asserted);
* sum/mean over every dim, several and all, keepdim or not, and amax/amin/max/min of
  integer-valued data (ties across shards): values and input gradients equal float64 tensors on
  one process.

Generated cases are seeded and counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=120)


def _cast_cases(rank: int, world: int) -> dict[str, Any]:
    """Terms k/256 with |k| < 2**20: their float32 sums are exact (any summation order agrees) but
    float16 and bfloat16 round them, so rounding each term first shows."""
    import torch
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import init_device_mesh as torch_mesh

    from hp_dtensor import CommDebugMode, DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    tmesh = torch_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    casts = [
        ("to(float16)", lambda t: t.to(torch.float16)),
        ("half()", lambda t: t.half()),
        ("bfloat16()", lambda t: t.bfloat16()),
        ("to(dtype=bfloat16)", lambda t: t.to(dtype=torch.bfloat16)),
    ]
    out: dict[str, Any] = {"checked": 0, "wrong": [], "torch_dtensor_err": 0.0, "widening": set()}
    for case in range(6):
        terms = [torch.randint(-(2**20), 2**20, (4, 8), generator=g).float() / 256 for _ in range(world)]
        for op in ("sum", "avg"):
            total = torch.stack(terms).double().sum(0) / (world if op == "avg" else 1)
            x = DTensor.from_local(terms[rank], mesh, [Partial(op)])
            tx = TorchDTensor.from_local(terms[rank], tmesh, [TorchPartial(op)])
            for name, f in casts:
                got = f(x).full_tensor().float()
                want = f(total.float()).float()
                out["checked"] += 1
                if not torch.equal(got, want):
                    out["wrong"].append((case, op, name, float((got - want).abs().max())))
                theirs = f(tx).full_tensor().float()
                out["torch_dtensor_err"] = max(out["torch_dtensor_err"], float((theirs - want).abs().max()))
            t64 = [t.double() + 1e-9 * torch.randn(4, 8, generator=g, dtype=torch.float64) for t in terms]
            s64 = torch.stack(t64).sum(0) / (world if op == "avg" else 1)
            got = DTensor.from_local(t64[rank], mesh, [Partial(op)]).float().full_tensor()
            out["checked"] += 1
            if not torch.equal(got, s64.float()):
                out["wrong"].append((case, op, "float64 .float()", float((got - s64.float()).abs().max())))
            with CommDebugMode() as comm:
                y = DTensor.from_local(terms[rank].half(), mesh, [Partial(op)]).float()
            out["widening"].add((comm.get_total_counts(), str(y.placements)))
    # the gradient through the reduce-first cast: the global gradient on every rank's term
    G = torch.randn(4, 8, generator=g)
    xl = terms[rank].clone().requires_grad_(True)
    (DTensor.from_local(xl, mesh, [Partial("sum")]).half().full_tensor().float() * G).sum().backward()
    out["grad_err"] = float((xl.grad - G.half().float()).abs().max())
    out["widening"] = sorted(out["widening"])
    return out


def test_narrowing_cast_of_a_partial_reduces_first(pool2: RankPool) -> None:
    results = pool2.run(_cast_cases)
    for rank, r in enumerate(results):
        assert not r["wrong"], f"rank {rank}: {r['wrong'][:6]}"
        assert r["widening"] == [(0, "(Partial(sum),)"), (0, "(Partial(avg),)")] or all(
            c == 0 and "Partial" in p for c, p in r["widening"]
        ), r["widening"]
        assert r["grad_err"] < 1e-6
    assert results[0]["checked"] == 60
    print(f"\ncasts of a Partial: {results[0]['checked']} cases x 2 ranks equal the one-process cast bit for bit "
          f"(torch.distributed.tensor, casting each term: max error {results[0]['torch_dtensor_err']:.3g})")


def _reduction_cases(rank: int, world: int, n_cases: int) -> dict[str, Any]:
    import torch

    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    stats: dict[str, Any] = {"cases": 0, "wrong": []}
    for _ in range(n_cases):
        ndim = int(torch.randint(1, 4, (1,), generator=g))
        shape = tuple(int(s) for s in torch.tensor([2, 4])[torch.randint(0, 2, (ndim,), generator=g)])
        d = int(torch.randint(0, ndim, (1,), generator=g))
        dims = sorted({int(v) for v in torch.randint(0, ndim, (int(torch.randint(1, ndim + 1, (1,), generator=g)),),
                                                    generator=g)})
        keep = bool(torch.rand(1, generator=g) < 0.5)
        sd = int(torch.randint(-1, ndim, (1,), generator=g))
        pl = [Shard(sd)] if sd >= 0 else [Replicate()]
        A = torch.randn(shape, generator=g, dtype=torch.float64)
        T = torch.randint(0, 3, shape, generator=g).double()  # integer values: ties across shards
        ops: list[tuple[str, torch.Tensor, Callable[..., torch.Tensor]]] = [
            (f"sum({d}, {keep})", A, lambda t, d=d, keep=keep: t.sum(d, keepdim=keep)),
            (f"mean({d}, {keep})", A, lambda t, d=d, keep=keep: t.mean(d, keepdim=keep)),
            (f"mean({dims}, {keep})", A, lambda t, dims=dims, keep=keep: t.mean(dims, keepdim=keep)),
            ("mean()", A, lambda t: t.mean()),
            (f"sum({dims})", A, lambda t, dims=dims: t.sum(dims)),
            (f"amax({d}, {keep})", T, lambda t, d=d, keep=keep: t.amax(d, keepdim=keep)),
            (f"amin({dims})", T, lambda t, dims=dims: t.amin(dims)),
            ("max()", T, lambda t: t.max()),
            ("min()", T, lambda t: t.min()),
        ]
        for name, src, f in ops:
            ref_x = src.clone().requires_grad_(True)
            ref = f(ref_x)
            G = torch.randn(ref.shape, generator=g, dtype=torch.float64)
            (ref * G).sum().backward()
            x = distribute_tensor(src.clone(), mesh, pl).requires_grad_(True)
            y = f(x)
            full = y.full_tensor()
            (full * G).sum().backward()
            stats["cases"] += 1
            ok = tuple(full.shape) == tuple(ref.shape) and torch.allclose(full, ref.detach(), rtol=1e-12, atol=1e-12)
            ok = ok and torch.allclose(x.grad.full_tensor(), ref_x.grad, rtol=1e-12, atol=1e-12)
            if not ok:
                stats["wrong"].append((name, shape, str(pl)))
    return stats


def test_sum_mean_max_min_gradients_match_one_process(pool2: RankPool) -> None:
    results = pool2.run(_reduction_cases, 30)
    for rank, s in enumerate(results):
        assert not s["wrong"], f"rank {rank}: {s['wrong'][:6]}"
    assert results[0]["cases"] == 270
    print(f"\nsum/mean/max/min: {results[0]['cases']} generated cases x 2 ranks, values and gradients match "
          f"float64 on one process")
