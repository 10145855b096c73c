# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr"
"""Reductions of sharded DTensors on 2 MindSpore ranks against the same op on the whole tensor in
one process: any/all (bool, through comparisons), max/min/amax/amin, and an int64 sum.  Seeded
shapes with the shard on a reduced or a kept dim; value, shape (a full reduction stays 0-d) and
dtype must match, no op may fall back to gathering its input, and a reduced shard costs one
all_reduce, never an all_gather."""

from __future__ import annotations

import warnings

import numpy as np

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
CASES = 40


def _ops(sd: int):
    import mindspore as ms
    from mindspore import ops

    return [
        ("any", lambda t: (t > 1.0).any(), True),
        ("all", lambda t: (t > -1.5).all(), True),
        ("any_dim", lambda t: (t > 1.0).any(sd), True),
        ("all_dim_keep", lambda t: (t > -1.0).all(sd, keep_dims=True), True),
        ("ops_any", lambda t: ops.any(t > 0.5), True),
        # MindSpore's own max/amax treat NaN by position (amax([1, nan, 3]) is 3, amax([nan, 3])
        # is nan): no reference to match, so these run on NaN-free data only.
        ("max", lambda t: t.max(), False),
        ("min", lambda t: t.min(), False),
        ("amax_dim_int", lambda t: t.astype(ms.int32).amax(sd), False),
        ("amax_keep", lambda t: ops.amax(t, sd, True), False),
        ("amin_all", lambda t: ops.amin(t), False),
        ("int64_sum", lambda t: (t * 10).astype(ms.int64).sum(), False),
    ]


def _cases(rank: int, world: int) -> dict:
    from mindspore import Tensor

    from hp_dtensor import CommDebugMode, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    rs = np.random.RandomState(7)
    wrong, fell, counts, n = [], set(), set(), 0
    for case in range(CASES):
        nd = rs.randint(1, 4)
        shape = tuple(int(s) for s in rs.randint(1, 5, size=nd) * world)
        sd = int(rs.randint(0, nd))
        a = rs.randn(*shape).astype(np.float32)
        with_nan = case % 4 == 0
        if with_nan:
            a.reshape(-1)[rs.randint(a.size)] = np.nan
        for name, fn, nan_ok in _ops(sd):
            if with_nan and not nan_ok:
                continue
            x = distribute_tensor(Tensor(a), mesh, [Shard(sd)])
            with warnings.catch_warnings(record=True) as w, CommDebugMode() as comm:
                warnings.simplefilter("always")
                r = fn(x)
                full = r.full_tensor().asnumpy()
            ref = fn(Tensor(a)).asnumpy()
            n += 1
            if not (full.shape == ref.shape and full.dtype == ref.dtype and np.array_equal(full, ref, equal_nan=True)):
                wrong.append((case, name, shape, sd, full.shape, ref.shape, str(full.dtype), str(ref.dtype)))
            fell |= {str(m.message) for m in w if "no sharding rule" in str(m.message)}
            counts.add(tuple(sorted(comm.get_comm_counts().items())))
    return {"n": n, "wrong": wrong, "fell": sorted(fell), "counts": sorted(counts)}


def test_reductions_of_shards_match_the_whole_tensor(pool: RankPool) -> None:
    results = pool.run(_cases)
    for res in results:
        assert not res["wrong"], res["wrong"][:5]
        assert not res["fell"], res["fell"]
        # the partial result's one all_reduce (full_tensor), or the shard's all_gather for a kept dim
        assert set(res["counts"]) <= {(("all_reduce", 1),), (("all_gather", 1),)}, res["counts"]
        assert (("all_reduce", 1),) in res["counts"]
    print(f"reductions: {results[0]['n']} generated cases x 2 ranks matched MindSpore on the whole tensor")
