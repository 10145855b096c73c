# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,var-annotated,assignment"
"""Input gradients of MindSpore DTensor sums, means and casts on 4 mccl ranks against one-process
MindSpore: the classes where values were right and gradients silently wrong.

* sum and mean (``mint``, ``Tensor`` methods and the ``ReduceSum``/``ReduceMean`` primitives) over
  every dim, several dims and all, with and without keepdim, sharded on reduced and kept dims, on
  a 1-D and a 2x2 mesh: a mean over a sharded dim makes a ``Partial("avg")`` whose gradient is
  1/n of what the local backward gives; a ``Partial("avg")`` factor times a replicated one too;
* a cast of a ``Partial`` to a narrower float (float16, bfloat16, float64 -> float32) reduces
  first and equals the one-process cast bit for bit; a widening cast stays Partial.

Max/min, norm and dense are in ``test_ms_extremum_gradients_4rank.py`` (two files, so that each
stays about a minute on 2 cores).  Generated cases are seeded and counted; ranks start once for
the module."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from ms_gradient_cases import MESHES, abs_err, compare, random_placements

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})

# ---------------------------------------------------------------- sum and mean
def _sum_mean_ops(rs, ndim):
    from mindspore import mint, ops

    d = int(rs.randint(ndim))
    dims = tuple(sorted({int(x) for x in rs.randint(ndim, size=rs.randint(1, ndim + 1))}))
    keep = bool(rs.rand() < 0.5)
    return [
        (f"mint.sum(x, {d}, {keep})", lambda t: mint.sum(t, d, keep)),
        (f"mint.mean(x, {d}, {keep})", lambda t: mint.mean(t, d, keep)),
        (f"mint.mean(x, {dims}, {keep})", lambda t: mint.mean(t, dims, keep)),
        ("x.mean()", lambda t: t.mean()),
        ("x.sum()", lambda t: t.sum()),
        (f"x.mean({d})", lambda t: t.mean(d)),
        (f"ops.ReduceSum({keep})(x, {dims})", lambda t: ops.ReduceSum(keep)(t, dims)),
        (f"ops.ReduceMean({keep})(x, {d})", lambda t: ops.ReduceMean(keep)(t, d)),
        (f"ops.mean(x, {dims}, {keep})", lambda t: ops.mean(t, dims, keep)),
        ("ops.ReduceMean()(x, ())", lambda t: ops.ReduceMean()(t, ())),
    ]


def _sum_mean_cases(rank, world, mesh_shape, n_cases):
    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rs = np.random.RandomState(100 + len(mesh_shape))
    stats: dict[str, Any] = {"cases": 0, "mean_over_shard": 0, "wrong": [], "fell": set(), "worst": (0.0, 0.0)}
    for _ in range(n_cases):
        ndim = int(rs.randint(1, 4))
        shape = tuple(int(s) for s in rs.choice([4, 8], size=ndim))
        pl = random_placements(rs, ndim, mesh_shape)
        A = rs.randn(*shape).astype(np.float32)
        for name, f in _sum_mean_ops(rs, ndim):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                v, g = compare(mesh, pl, A, f, lambda shape: rs.randn(*shape))
            stats["fell"] |= {str(m.message) for m in w if "no sharding rule" in str(m.message)}
            stats["cases"] += 1
            stats["mean_over_shard"] += "mean" in name.lower() and any(p.is_shard() for p in pl)
            if v > 1 or g > 1:
                stats["wrong"].append((name, shape, str(pl), round(v, 2), round(g, 2)))
    # the cases, as absolute errors: mean over dim 0 sharded on it
    from mindspore import mint

    from hp_dtensor import Replicate, Shard

    A = np.random.RandomState(1).randn(8, 8).astype(np.float32)
    G = np.random.RandomState(2).randn(8).astype(np.float32)
    layouts = [[Shard(0)]] if len(mesh_shape) == 1 else [[Shard(0), Shard(1)], [Replicate(), Shard(0)]]
    stats["worst"] = max(abs_err(mesh, pl, A, G, lambda t: mint.mean(t, 0))[1] for pl in layouts)
    stats["fell"] = sorted(stats["fell"])
    return stats


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sum_and_mean_gradients_match_one_process(pool, mesh_shape):
    results = pool.run(_sum_mean_cases, mesh_shape, 24)
    for rank, s in enumerate(results):
        assert not s["wrong"], f"rank {rank}: {s['wrong'][:6]}"
        assert not s["fell"], s["fell"]
    s = results[0]
    assert s["cases"] == 240 and s["mean_over_shard"] > 40
    worst = max(r["worst"] for r in results)
    print(f"sum/mean on mesh {mesh_shape}: {s['cases']} generated cases x 4 ranks ({s['mean_over_shard']} means of "
          f"sharded inputs) match one process; mint.mean(x, 0) gradient max error {worst:.2e}")


def _avg_times_replicated(rank, world, mesh_shape):
    """A Partial("avg") factor times a replicated DTensor: the replicated factor's gradient is
    G times the *average* of the terms (its local backward gives each rank G times its own term,
    whose sum over the ranks is n times too much)."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Partial, Replicate, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    terms = [np.random.RandomState(10 + r).randn(4, 6).astype(np.float32) for r in range(world)]
    Y = np.random.RandomState(3).randn(4, 6).astype(np.float32)
    G = np.random.RandomState(4).randn(4, 6).astype(np.float32)
    avg = [Partial("avg")] * len(mesh_shape)
    rep = [Replicate()] * len(mesh_shape)

    def loss(yl, xl):
        y = DTensor.from_local(yl, mesh, rep)
        x = DTensor.from_local(xl, mesh, avg)
        return ((x * y).full_tensor() * Tensor(G)).sum()

    gy, gx = ms.grad(loss, (0, 1))(Tensor(Y), Tensor(terms[rank]))
    mean = sum(terms) / world
    return float(np.abs(gy.asnumpy() - G * mean).max()), float(np.abs(gx.asnumpy() - G * Y).max())


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_partial_avg_times_replicated_gradient(pool, mesh_shape):
    for gy_err, gx_err in pool.run(_avg_times_replicated, mesh_shape):
        assert gy_err < 1e-5 and gx_err < 1e-5, (gy_err, gx_err)


# ---------------------------------------------------------------- casts of a Partial
def _cast_cases(rank, world, mesh_shape):
    """Terms k/256 with |k| < 2**20: their sums are exact in float32 (so any summation order gives
    the same float32 value) but not in float16, so casting each term first rounds it."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor import CommDebugMode, DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rs = np.random.RandomState(500)
    out: dict[str, Any] = {"checked": 0, "wrong": [], "worst": 0.0, "widening_comms": set(), "widening_placements": set()}
    casts = [
        ("astype(float16)", lambda t: t.astype(ms.float16)),
        ("ops.cast(bfloat16)", lambda t: ops.cast(t, ms.bfloat16)),
        ("to(float16)", lambda t: t.to(ms.float16)),
        ("half()", lambda t: t.half()),
    ]
    for case in range(6):
        terms = [(rs.randint(-(2**20), 2**20, size=(4, 8)) / 256.0).astype(np.float32) for _ in range(world)]
        for op in ("sum", "avg"):
            total = np.sum(np.stack(terms).astype(np.float64), axis=0)
            if op == "avg":
                total = total / world
            pl = [Partial(op)] * len(mesh_shape)
            x = DTensor.from_local(Tensor(terms[rank]), mesh, pl)
            for name, f in casts:
                got = f(x).full_tensor().astype(ms.float32).asnumpy()
                want = f(Tensor(total.astype(np.float32))).astype(ms.float32).asnumpy()
                out["checked"] += 1
                out["worst"] = max(out["worst"], float(np.abs(got - want).max()))
                if not np.array_equal(got, want):
                    out["wrong"].append((case, op, name, float(np.abs(got - want).max())))
            # float64 terms with digits float32 lacks, cast to float32: reduced in float64 first
            t64 = [t.astype(np.float64) + 1e-9 * rs.randn(4, 8) for t in terms]
            x64 = DTensor.from_local(Tensor(t64[rank]), mesh, pl)
            s64 = np.sum(np.stack(t64), axis=0) / (world if op == "avg" else 1)
            got = x64.astype(ms.float32).full_tensor().asnumpy()
            if not np.array_equal(got, s64.astype(np.float32)):
                out["wrong"].append((case, op, "float64->float32", float(np.abs(got - s64.astype(np.float32)).max())))
            out["checked"] += 1
            # widening keeps the Partial: no collective until it is reduced
            with CommDebugMode() as comm:
                y = DTensor.from_local(Tensor(terms[rank]).astype(ms.float16), mesh, pl).astype(ms.float32)
            out["widening_comms"].add(comm.get_total_counts())
            out["widening_placements"].add(str(y.placements))
    # the gradient through a narrowing cast of a Partial: G on every rank's term (torch's convention)
    G = rs.randn(4, 8).astype(np.float32)

    def loss(xl):
        x = DTensor.from_local(xl, mesh, [Partial("sum")] * len(mesh_shape))
        return (x.astype(ms.float16).full_tensor().astype(ms.float32) * Tensor(G)).sum()

    grad = ms.grad(loss)(Tensor(terms[rank])).asnumpy()
    out["grad_err"] = float(np.abs(grad - G.astype(np.float16).astype(np.float32)).max())
    out["widening_comms"] = sorted(out["widening_comms"])
    out["widening_placements"] = sorted(out["widening_placements"])
    return out


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_narrowing_cast_of_a_partial_reduces_first(pool, mesh_shape):
    results = pool.run(_cast_cases, mesh_shape)
    for rank, r in enumerate(results):
        assert not r["wrong"], f"rank {rank}: {r['wrong'][:6]}"
        assert r["widening_comms"] == [0], r["widening_comms"]
        assert all("Partial" in p for p in r["widening_placements"]), r["widening_placements"]
        assert r["grad_err"] < 1e-6
    assert results[0]["checked"] == 60
    print(f"casts of a Partial on mesh {mesh_shape}: {results[0]['checked']} cases x 4 ranks equal the "
          f"one-process cast bit for bit (max error {max(r['worst'] for r in results):.2e})")
