# mypy: disable-error-code="no-untyped-def,import-not-found,import-untyped"
"""``from_local(run_check=True)`` is one implementation: the same bad inputs on 2 torch (gloo) ranks
and on 2 MindSpore (mccl) ranks raise the same ``ValueError`` with the same message on every rank
of both, and the same good inputs pass with the same values.

The cases are what a careless user passes: ndim, dtype, placements or ``shape=`` differing by rank,
uneven shards without ``shape=``, shards that do not tile ``shape=``, a bad argument on one rank
only, and ``Replicate`` data that differ in ways a float-sum checksum misses (one NaN hiding a
difference elsewhere, ``-0.0`` against ``0.0``, ``1e20 + 1`` against ``1e20 + 2``), bfloat16,
0-d tensors and non-contiguous views (compared by value, not by memory layout)."""

from __future__ import annotations

import numpy as np

from hp_dtensor.testing import rank_pool_fixture

ms_pool = rank_pool_fixture(2, timeout=120, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=120, env={"HYPER_PARALLEL_PLATFORM": "torch"})

_PREFIX = "from_local(run_check=True): "
_DIFFERENT = "placement Replicate() on mesh dim 0 but ranks [0, 1] hold different data (ranks [1] differ from rank 0"
# case -> the text every rank's ValueError must contain ("ok": accepted, full_tensor compared)
EXPECTED = {
    "ndim": "the ndim differs across the mesh (rank 0: 2, rank 1: 3); pass the same on every rank",
    "dtype": "the dtype differs across the mesh (rank 0: float32, rank 1: int32); pass the same on every rank",
    "placements": "the placements differs across the mesh (rank 0: [Replicate()], rank 1: [Shard(dim=0)])",
    "shape_arg": "the shape= argument differs across the mesh (rank 0: (6, 4), rank 1: (5, 4))",
    "uneven_without_shape": "the local shape differs across the mesh (rank 0: (4, 3), rank 1: (3, 3)); uneven "
                            "shards need the global shape=",
    "does_not_tile": "local shards do not tile shape=(7, 3) with placements (Shard(dim=0),) (rank 0: (4, 3) "
                     "(want (4, 3)), rank 1: (4, 3) (want (3, 3)))",
    "bad_stride_on_one_rank": "the arguments failed their checks on ranks [1]",
    "replicate_data": _DIFFERENT,
    "replicate_nan_hides_a_difference": _DIFFERENT,
    "replicate_negative_zero": _DIFFERENT,
    "replicate_1e20_plus_one": _DIFFERENT,
    "replicate_bfloat16": _DIFFERENT,
    "replicate_scalar": _DIFFERENT,
    "noncontiguous_differs": _DIFFERENT,
    "replicate_same_nan": "ok",
    "noncontiguous_same_values": "ok",
    "uneven_with_shape": "ok",
    "bool_same": "ok",
}


def _inputs(rank):
    """case -> (this rank's values, dtype, placement, shape=, stride=, pass a transposed view)."""
    f32 = np.float32
    A = np.arange(12, dtype=f32).reshape(3, 4)
    nan = A.copy()
    nan[0, 0] = np.nan
    nan_b = nan.copy()
    nan_b[2, 3] += rank  # a float sum is NaN on both ranks: it cannot see this
    B = np.arange(21, dtype=f32).reshape(7, 3)
    return {
        "ndim": (A if rank == 0 else A.reshape(3, 4, 1), "float32", "S0", None, None, False),
        "dtype": (A, "float32" if rank == 0 else "int32", "S0", None, None, False),
        "placements": (A, "float32", "R" if rank == 0 else "S0", None, None, False),
        "shape_arg": (A, "float32", "S0", (6, 4) if rank == 0 else (5, 4), None, False),
        "uneven_without_shape": (np.ones((4 - rank, 3), f32), "float32", "S0", None, None, False),
        "does_not_tile": (np.ones((4, 3), f32), "float32", "S0", (7, 3), None, False),
        "bad_stride_on_one_rank": (A, "float32", "R", None, (4, 1) if rank == 0 else (1, 3), False),
        "replicate_data": (A + rank, "float32", "R", None, None, False),
        "replicate_nan_hides_a_difference": (nan_b, "float32", "R", None, None, False),
        "replicate_negative_zero": (np.zeros(3, f32) * (1 - 2 * rank), "float32", "R", None, None, False),
        "replicate_1e20_plus_one": (np.array([1e20, 1.0 + rank]), "float64", "R", None, None, False),
        "replicate_bfloat16": (np.array([1.5, 2.0 + rank / 2, -0.25], f32), "bfloat16", "R", None, None, False),
        "replicate_scalar": (np.array(3.0 + rank / 2, f32), "float32", "R", None, None, False),
        # the transpose of (A + rank).T: A + rank's values in a non-contiguous view on rank 1
        "noncontiguous_differs": ((A + rank).T.copy() if rank else A, "float32", "R", None, None, rank == 1),
        "replicate_same_nan": (nan, "float32", "R", None, None, False),
        "noncontiguous_same_values": (A.T.copy() if rank else A, "float32", "R", None, None, rank == 1),
        "uneven_with_shape": (B[:4] if rank == 0 else B[4:], "float32", "S0", (7, 3), None, False),
        "bool_same": (A > 5, "bool", "R", None, None, False),
    }


def _run(rank, world, framework):
    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if framework == "mindspore":
        import mindspore as ms
        from mindspore import Tensor

        def make(a, dtype, view):
            t = Tensor(np.ascontiguousarray(a))
            t = t.astype(getattr(ms, dtype)) if str(t.dtype).lower() != dtype else t
            return t.transpose(1, 0) if view else t

        def values(dt):
            return repr(dt.full_tensor().asnumpy().tolist())
    else:
        import torch

        def make(a, dtype, view):
            t = torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))
            return t.transpose(0, 1) if view else t

        def values(dt):
            return repr(dt.full_tensor().tolist())

    out = {}
    for name, (a, dtype, pl, shape, stride, view) in _inputs(rank).items():
        t = make(a, dtype, view)
        try:
            dt = DTensor.from_local(t, mesh, [Replicate() if pl == "R" else Shard(0)], run_check=True,
                                    shape=shape, stride=stride)
            out[name] = ("ok", values(dt), "", bool(view) and not t.is_contiguous())
        except Exception as e:  # noqa: BLE001 -- the type is part of what is compared
            cause = e.__cause__
            out[name] = (type(e).__name__, str(e), "" if cause is None else f"{type(cause).__name__}: {cause}",
                         bool(view) and not t.is_contiguous())
    return out


def test_run_check_is_the_same_on_torch_and_mindspore(ms_pool, torch_pool) -> None:
    ms_res = ms_pool.run(_run, "mindspore")
    torch_res = torch_pool.run(_run, "torch")
    for name, want in EXPECTED.items():
        kinds = {(fw, rank): res[name] for fw, results in (("torch", torch_res), ("ms", ms_res))
                 for rank, res in enumerate(results)}
        for where, (kind, msg, _, _) in kinds.items():
            if want == "ok":
                assert kind == "ok", (name, where, msg)
            else:
                assert kind == "ValueError" and msg.startswith(_PREFIX) and want in msg, (name, where, kind, msg)
        # one verdict: the same message on every rank of both frameworks
        assert len({(k, m) for k, m, _, _ in kinds.values()}) == 1, (name, kinds)
        # a rank whose own argument was wrong carries its own error as the cause, the same on both
        causes = [[res[name][2] for res in results] for results in (torch_res, ms_res)]
        assert causes[0] == causes[1], (name, causes)
        if name == "bad_stride_on_one_rank":
            assert causes[0][0] == "" and "is not the contiguous stride" in causes[0][1], causes
    # the views really were non-contiguous on rank 1 of both frameworks
    for results in (torch_res, ms_res):
        assert results[1]["noncontiguous_same_values"][3] and results[1]["noncontiguous_differs"][3]
    assert torch_res[0]["uneven_with_shape"][1] == repr(np.arange(21.0).reshape(7, 3).tolist())
    print(f"run_check parity: {len(EXPECTED)} cases x 2 ranks x 2 frameworks, "
          f"{sum(w != 'ok' for w in EXPECTED.values())} rejected with one message each")

