# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,var-annotated,assignment"
"""Input gradients of MindSpore DTensor max/min on 4 mccl ranks against one-process MindSpore:
amax/amin/max/min of integer-valued data (ties everywhere), sharded on the reduced dim, where values
were right and gradients silently wrong.  The gradient is split evenly among the *global* ties
across shards, as MindSpore splits it.  (``ops.norm`` and ``ops.dense``, the other ops whose
gradients were wrong, are ``test_ms_norm_dense_gradients_4rank.py``'s: one file each keeps both
under a minute and a half on 2 loaded cores.)

Generated cases are seeded and counted; ranks start once for the module."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from ms_gradient_cases import MESHES, abs_err, compare, random_placements

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})

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

    from hp_dtensor import Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rs = np.random.RandomState(200 + len(mesh_shape))
    stats: dict[str, Any] = {"cases": 0, "ties_across_shards": 0, "wrong": [], "fell": set(), "counts": set()}
    for _ in range(n_cases):
        ndim = int(rs.randint(1, 4))
        shape = tuple(int(s) for s in rs.choice([4, 8], size=ndim))
        pl = random_placements(rs, ndim, mesh_shape)
        A = rs.randint(0, 3, size=shape).astype(np.float32)  # integer values: ties everywhere
        for name, f in _extremum_ops(rs, ndim):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                v, g = compare(mesh, pl, A, f, lambda shape: rs.randn(*shape), stats["counts"])
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
    stats["worst"] = abs_err(mesh, pl, A, G, lambda t: ops.amax(t, 1))[1]
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
