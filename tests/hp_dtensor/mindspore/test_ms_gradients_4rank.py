# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,var-annotated,assignment"
"""Input gradients of MindSpore DTensor ops on 4 mccl ranks against one-process MindSpore: the
classes where values were right and gradients silently wrong, or the op did not run at all.

* sum and mean (``mint``, ``Tensor`` methods and the ``ReduceSum``/``ReduceMean`` primitives) over
  every dim, several dims and all, with and without keepdim, sharded on reduced and kept dims, on
  a 1-D and a 2x2 mesh: a mean over a sharded dim makes a ``Partial("avg")`` whose gradient is
  1/n of what the local backward gives; a ``Partial("avg")`` factor times a replicated one too;
* amax/amin/max/min of integer-valued data (ties everywhere), sharded on the reduced dim: the
  gradient is split evenly among the *global* ties across shards, as MindSpore splits it;
* ``ops.norm`` (its ReduceSum primitive takes a nested axis list; ``ops.norm(x, p, dim)`` is the
  LpNorm primitive) and ``ops.dense`` with every layout of input, weight and bias;
* a cast of a ``Partial`` to a narrower float (float16, bfloat16, float64 -> float32) reduces
  first and equals the one-process cast bit for bit; a widening cast stays Partial.

Generated cases are seeded and counted; ranks start once for the module."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})

MESHES = [(4,), (2, 2)]
RTOL, ATOL = 1.5e-4, 1e-5


def _slice(a, placements, mesh_shape, coord):
    """This rank's shard of ``a`` (nested shards split the previous mesh dim's chunk, as torch)."""
    for k, p in enumerate(placements):
        if p.is_shard():
            a = np.split(a, mesh_shape[k], axis=p.dim)[coord[k]]
    return a


def _random_placements(rs, ndim, mesh_shape):
    from hp_dtensor import Replicate, Shard

    return [Shard(int(rs.randint(ndim))) if rs.rand() < 0.75 else Replicate() for _ in mesh_shape]


def _compare(mesh, placements, A, G, f, comm_counts=None):
    """(value error, gradient error) of ``f`` on the DTensor laid out from ``A`` against ``f`` on
    ``A`` in one process; the loss is sum(f(x) * G) and the gradient is compared shard by shard.
    The value compared is the one the gradient's forward computed (one forward and one gather per
    case, not two).  ``comm_counts``, when given, receives the collectives ``f`` alone issues."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import CommDebugMode, DTensor

    coord = mesh.get_coordinate()
    local = Tensor(_slice(A, placements, mesh.shape, coord))

    def loss(xl):
        out = f(DTensor.from_local(xl, mesh, placements)).full_tensor()
        return (out * Tensor(G)).sum(), out

    def ref_loss(x):
        out = f(x)
        return (out * Tensor(G)).sum(), out

    (_, got), grad = ms.value_and_grad(loss, grad_position=0, has_aux=True)(local)
    (_, want), want_grad = ms.value_and_grad(ref_loss, grad_position=0, has_aux=True)(Tensor(A))
    if comm_counts is not None:
        with CommDebugMode() as comm:
            f(DTensor.from_local(local, mesh, placements))
        comm_counts.add(tuple(sorted(comm.get_comm_counts().items())))
    got, want, grad = got.asnumpy(), want.asnumpy(), grad.asnumpy()
    want_grad = _slice(want_grad.asnumpy(), placements, mesh.shape, coord)
    if got.shape != want.shape or grad.shape != want_grad.shape:
        return float("inf"), float("inf")
    return _rel_err(got, want), _rel_err(grad, want_grad)


def _rel_err(got, want):
    """max |got - want| in units of the fp32 tolerance (<= 1 passes)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want) / (ATOL + RTOL * np.abs(want))))


def _abs_err(mesh, placements, A, G, f):
    """The plain max absolute errors (value, gradient), for the figures printed."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor

    coord = mesh.get_coordinate()
    local = Tensor(_slice(A, placements, mesh.shape, coord))
    got = f(DTensor.from_local(local, mesh, placements)).full_tensor().asnumpy()
    want = f(Tensor(A)).asnumpy()
    grad = ms.grad(lambda xl: (f(DTensor.from_local(xl, mesh, placements)).full_tensor() * Tensor(G)).sum())(local)
    want_grad = _slice(ms.grad(lambda x: (f(x) * Tensor(G)).sum())(Tensor(A)).asnumpy(), placements, mesh.shape, coord)
    return float(np.abs(got - want).max()), float(np.abs(grad.asnumpy() - want_grad).max())


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
        pl = _random_placements(rs, ndim, mesh_shape)
        A = rs.randn(*shape).astype(np.float32)
        for name, f in _sum_mean_ops(rs, ndim):
            want_shape = f(__import__("mindspore").Tensor(A)).shape
            G = np.asarray(rs.randn(*want_shape), np.float32)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                v, g = _compare(mesh, pl, A, G, f)
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
    stats["worst"] = max(_abs_err(mesh, pl, A, G, lambda t: mint.mean(t, 0))[1] for pl in layouts)
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


# ---------------------------------------------------------------- max and min with ties
def _extremum_ops(rs, ndim):
    from mindspore import mint, ops

    d = int(rs.randint(ndim))
    dims = tuple(sorted({int(x) for x in rs.randint(ndim, size=rs.randint(1, ndim + 1))}))
    keep = bool(rs.rand() < 0.5)
    return [
        (f"ops.amax(x, {d}, {keep})", lambda t: ops.amax(t, d, keep)),
        (f"ops.amin(x, {d}, {keep})", lambda t: ops.amin(t, d, keep)),
        (f"mint.amax(x, {dims}, {keep})", lambda t: mint.amax(t, dims, keep)),
        (f"x.amin({dims})", lambda t: t.amin(dims)),
        ("mint.max(x)", lambda t: mint.max(t)),
        ("mint.min(x)", lambda t: mint.min(t)),
        (f"ops.ReduceMax({keep})(x, {d})", lambda t: ops.ReduceMax(keep)(t, d)),
    ]


def _extremum_cases(rank, world, mesh_shape, n_cases):
    from mindspore import Tensor

    from hp_dtensor import Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rs = np.random.RandomState(200 + len(mesh_shape))
    stats: dict[str, Any] = {"cases": 0, "ties_across_shards": 0, "wrong": [], "fell": set(), "counts": set()}
    for _ in range(n_cases):
        ndim = int(rs.randint(1, 4))
        shape = tuple(int(s) for s in rs.choice([4, 8], size=ndim))
        pl = _random_placements(rs, ndim, mesh_shape)
        A = rs.randint(0, 3, size=shape).astype(np.float32)  # integer values: ties everywhere
        for name, f in _extremum_ops(rs, ndim):
            G = np.asarray(rs.randn(*f(Tensor(A)).shape), np.float32)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                v, g = _compare(mesh, pl, A, G, f, stats["counts"])
            stats["fell"] |= {str(m.message) for m in w if "no sharding rule" in str(m.message)}
            stats["cases"] += 1
            stats["ties_across_shards"] += any(p.is_shard() for p in pl)
            if v > 1 or g > 1:
                stats["wrong"].append((name, shape, str(pl), round(v, 2), round(g, 2)))
    # the case: amax over dim 1 sharded on it, integer data
    from mindspore import ops

    A = np.random.RandomState(5).randint(0, 3, size=(8, 8)).astype(np.float32)
    G = np.random.RandomState(6).randn(8).astype(np.float32)
    pl = [Shard(1)] if len(mesh_shape) == 1 else [Shard(1), Replicate()]
    stats["worst"] = _abs_err(mesh, pl, A, G, lambda t: ops.amax(t, 1))[1]
    stats["fell"] = sorted(stats["fell"])
    stats["counts"] = sorted(stats["counts"])
    return stats


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_max_min_gradients_split_among_global_ties(pool, mesh_shape):
    results = pool.run(_extremum_cases, mesh_shape, 24)
    for rank, s in enumerate(results):
        assert not s["wrong"], f"rank {rank}: {s['wrong'][:6]}"
        assert not s["fell"], s["fell"]
        # a max over a shard reduces across ranks with all_reduce (one per mesh dim), never by
        # gathering its input (a move the rule asks for first, as for a nested shard, may gather)
        assert (("all_reduce", 1),) in s["counts"], s["counts"]
    s = results[0]
    assert s["cases"] == 168 and s["ties_across_shards"] > 60
    worst = max(r["worst"] for r in results)
    print(f"max/min with ties on mesh {mesh_shape}: {s['cases']} generated cases x 4 ranks match one process; "
          f"ops.amax(x, 1) gradient max error {worst:.2e}")


# ---------------------------------------------------------------- norm and dense
def _norm_cases(rank, world, mesh_shape):
    from mindspore import ops

    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rs = np.random.RandomState(300 + len(mesh_shape))
    fns = [
        ("ops.norm(x)", lambda t: ops.norm(t)),
        ("x.norm()", lambda t: t.norm()),
        ("ops.norm(x, dim=0)", lambda t: ops.norm(t, dim=0)),
        ("ops.norm(x, 3.0, dim=1, keepdim=True)", lambda t: ops.norm(t, 3.0, dim=1, keepdim=True)),
        ("ops.norm(x, 2, 1) (LpNorm)", lambda t: ops.norm(t, 2, 1)),
        ("ops.norm(x, 'fro')", lambda t: ops.norm(t, "fro")),
    ]
    wrong, n = [], 0
    for _ in range(8):
        A = rs.randn(8, 4).astype(np.float32)
        pl = _random_placements(rs, 2, mesh_shape)
        for name, f in fns:
            G = np.asarray(rs.randn(*f(__import__("mindspore").Tensor(A)).shape), np.float32)
            try:
                v, g = _compare(mesh, pl, A, G, f)
            except Exception as e:  # noqa: BLE001 -- a raise is one more failure to report
                wrong.append((name, str(pl), f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                continue
            n += 1
            if v > 1 or g > 1:
                wrong.append((name, str(pl), round(v, 2), round(g, 2)))
    return n, wrong


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_norm_values_and_gradients_match_one_process(pool, mesh_shape):
    results = pool.run(_norm_cases, mesh_shape)
    for rank, (n, wrong) in enumerate(results):
        assert not wrong, f"rank {rank}: {wrong[:6]}"
        assert n == 48
    print(f"ops.norm on mesh {mesh_shape}: {results[0][0]} generated cases x 4 ranks match one process")


def _dense_cases(rank, world, mesh_shape):
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    rs = np.random.RandomState(400 + len(mesh_shape))
    n, wrong = 0, []
    for xshape in ((8, 8), (4, 4, 8), (8,)):
        A = rs.randn(*xshape).astype(np.float32)
        W = rs.randn(12, 8).astype(np.float32)
        B = rs.randn(12).astype(np.float32)
        G = rs.randn(*(xshape[:-1] + (12,))).astype(np.float32)
        x_layouts = [Replicate()] + [Shard(d) for d in range(len(xshape))]
        for _ in range(12):
            xp = [x_layouts[rs.randint(len(x_layouts))] for _ in mesh_shape]
            wp = [[Replicate(), Shard(0), Shard(1)][rs.randint(3)] for _ in mesh_shape]
            bp = [[Replicate(), Shard(0)][rs.randint(2)] for _ in mesh_shape]
            with_bias = bool(rs.rand() < 0.8)
            f = (lambda x, w, b: ops.dense(x, w, b)) if with_bias else (lambda x, w, b: ops.dense(x, w))
            locs = [Tensor(_slice(a, p, mesh_shape, coord)) for a, p in ((A, xp), (W, wp), (B, bp))]

            def loss(xl, wl, bl, xp=xp, wp=wp, bp=bp, f=f, G=G):
                out = f(DTensor.from_local(xl, mesh, xp), DTensor.from_local(wl, mesh, wp),
                        DTensor.from_local(bl, mesh, bp))
                return (out.full_tensor() * Tensor(G)).sum()

            def ref_loss(x, w, b, f=f, G=G):
                return (f(x, w, b) * Tensor(G)).sum()

            case = (xshape, str(xp), str(wp), str(bp) if with_bias else "no bias")
            try:
                got = f(*(DTensor.from_local(t, mesh, p) for t, p in zip(locs, (xp, wp, bp)))).full_tensor().asnumpy()
                grads = ms.grad(loss, (0, 1, 2))(*locs)
            except Exception as e:  # noqa: BLE001 -- a raise is one more failure to report
                wrong.append((*case, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                continue
            want = f(Tensor(A), Tensor(W), Tensor(B)).asnumpy()
            want_grads = ms.grad(ref_loss, (0, 1, 2))(Tensor(A), Tensor(W), Tensor(B))
            errs = [_rel_err(got, want)]
            for g, wg, p in zip(grads, want_grads, (xp, wp, bp)):
                errs.append(_rel_err(g.asnumpy(), _slice(wg.asnumpy(), p, mesh_shape, coord)))
            n += 1
            if max(errs) > 1:
                wrong.append((*case, [round(e, 2) for e in errs]))
    return n, wrong


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_dense_with_every_layout_of_input_weight_and_bias(pool, mesh_shape):
    results = pool.run(_dense_cases, mesh_shape)
    for rank, (n, wrong) in enumerate(results):
        assert not wrong, f"rank {rank}: {wrong[:6]}"
        assert n == 36
    print(f"ops.dense on mesh {mesh_shape}: {results[0][0]} generated layouts x 4 ranks match one process "
          f"(values and the gradients of input, weight and bias)")


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
