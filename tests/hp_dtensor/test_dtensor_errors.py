# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Fail closed on 4 gloo ranks: bad inputs to the public API raise a clear error on every rank
within a second (no hang, no abort); ``from_local(run_check=True)`` compares one fixed-size record
per rank; mixed Partials are refused; Partial max/min keep NaN; uneven sharding follows torch."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=60)


def _attempt(fn: Callable[[], Any]) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return ("no error", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _bad_input(rank: int, world: int, case: str) -> tuple[str, str, float]:
    import torch

    from hp_dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh4 = init_device_mesh("cpu", (4,))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    local = torch.full((2, 3), float(rank))
    cases: dict[str, Callable[[], Any]] = {
        "mesh_world_mismatch": lambda: init_device_mesh("cpu", (2, 4)),
        "mesh_ranks_outside_world": lambda: DeviceMesh("cpu", [[0, 1], [2, 3], [4, 5]]),
        "ragged_mesh": lambda: DeviceMesh("cpu", [[0, 1], [2]]),
        "duplicate_mesh_ranks": lambda: DeviceMesh("cpu", [[0, 1], [1, 3]]),
        "duplicate_mesh_dim_names": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a")),
        "mesh_slice_same_dim_twice": lambda: named["a", "a"],
        "src_data_rank_out_of_range": lambda: distribute_tensor(torch.ones(4, 4), mesh4, [Shard(0)], src_data_rank=4),
        "src_data_rank_negative": lambda: distribute_tensor(torch.ones(4, 4), mesh4, [Shard(0)], src_data_rank=-1),
        "src_data_rank_beyond_a_mesh_dim": lambda: distribute_tensor(
            torch.ones(4, 4), named, [Shard(0), Replicate()], src_data_rank=2
        ),
        "unknown_device_type": lambda: init_device_mesh("tpu", (4,)),
        "partial_avg_on_int_distribute": lambda: distribute_tensor(
            torch.ones(4, dtype=torch.int64), mesh4, [Partial("avg")]
        ),
        "partial_avg_on_int_from_local": lambda: DTensor.from_local(
            torch.ones(4, dtype=torch.int32), mesh4, [Partial("avg")]
        ),
        "partial_avg_on_int_redistribute": lambda: distribute_tensor(
            torch.ones(4, dtype=torch.int64), mesh4, [Replicate()]
        ).redistribute(mesh4, [Partial("avg")]),
        "mixed_partials_from_local": lambda: DTensor.from_local(local, named, [Partial("sum"), Partial("max")]),
        "mixed_partials_redistribute": lambda: DTensor.from_local(local, named, [Partial("min"), Replicate()]).redistribute(
            named, [Partial("min"), Partial("avg")]
        ),
        "divergent_replicate_run_check": lambda: DTensor.from_local(local, mesh4, [Replicate()], run_check=True),
    }
    return _attempt(cases[case])


BAD_INPUTS = {
    "mesh_world_mismatch": ("ValueError", "needs 8 ranks but the world has 4"),
    "mesh_ranks_outside_world": ("ValueError", "mesh ranks [4, 5] are not ranks of the world (size 4)"),
    "ragged_mesh": ("ValueError", "is ragged"),
    "duplicate_mesh_ranks": ("ValueError", "mesh ranks must be distinct"),
    "duplicate_mesh_dim_names": ("ValueError", "mesh_dim_names must be unique"),
    "mesh_slice_same_dim_twice": ("ValueError", "names a mesh dim twice"),
    "src_data_rank_out_of_range": ("ValueError", "src_data_rank=4 is not a group rank"),
    "src_data_rank_negative": ("ValueError", "src_data_rank=-1 is not a group rank"),
    "src_data_rank_beyond_a_mesh_dim": ("ValueError", "must be in [0, 2)"),
    "unknown_device_type": ("ValueError", "device_type 'tpu' is not one of"),
    "partial_avg_on_int_distribute": ("ValueError", "Partial('avg') needs a floating-point tensor, got dtype torch.int64"),
    "partial_avg_on_int_from_local": ("ValueError", "got dtype torch.int32"),
    "partial_avg_on_int_redistribute": ("ValueError", "Partial('avg') needs a floating-point tensor"),
    "mixed_partials_from_local": ("ValueError", "mix Partial reduce ops ['max', 'sum']"),
    "mixed_partials_redistribute": ("ValueError", "mix Partial reduce ops ['avg', 'min']"),
    "divergent_replicate_run_check": ("ValueError", "placement Replicate() on mesh dim 0 but ranks [0, 1, 2, 3] hold different data"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_on_every_rank_within_a_second(pool4: RankPool, case: str) -> None:
    kind, text = BAD_INPUTS[case]
    results = pool4.run(_bad_input, case, timeout=30)
    for rank, (got, msg, seconds) in enumerate(results):
        assert got == kind and text in msg, f"rank {rank}: {got}: {msg}"
        assert seconds < 1.0, f"rank {rank} took {seconds:.2f} s"


# ---------------------------------------------------------------- from_local(run_check=True)
def _run_check(rank: int, world: int, case: str) -> tuple[str, str, float]:
    import torch

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    named = init_device_mesh("cpu", (2, 2))
    cases: dict[str, Callable[[], Any]] = {
        # used to pass the check; one rank then computed garbage and its peer died by SIGABRT
        "dtype": lambda: DTensor.from_local(
            torch.ones(2, 3, dtype=torch.int32 if rank == 2 else torch.float32), mesh, [Shard(0)], run_check=True
        ),
        # used to kill a rank by SIGABRT and report a made-up shape
        "ndim": lambda: DTensor.from_local(torch.ones(2, 3) if rank != 1 else torch.ones(2, 3, 1), mesh, [Shard(0)], run_check=True),
        # shape= wrong on 3 of 4 ranks: used to leave the 4th blocked forever in the gather
        "fails_on_three": lambda: DTensor.from_local(
            torch.ones(2, 3), mesh, [Shard(0)], shape=(8, 3) if rank == 0 else (9, 3), run_check=True
        ),
        "placements": lambda: DTensor.from_local(
            torch.ones(2, 3), mesh, [Shard(0) if rank else Replicate()], run_check=True
        ),
        # replicated across mesh dim 1 only: ranks (0,0),(0,1) agree, (1,0),(1,1) differ
        "divergent_on_one_dim": lambda: DTensor.from_local(
            torch.full((2,), float(rank // 2) + (0.5 if rank == 3 else 0.0)), named, [Shard(0), Replicate()], run_check=True
        ),
        "uneven_with_shape_ok": lambda: DTensor.from_local(
            torch.full((2 if rank < 3 else 0, 3), float(rank)), mesh, [Shard(0)], shape=(6, 3), run_check=True
        ).full_tensor()[:, 0].tolist(),
    }
    t0 = time.monotonic()
    try:
        out = cases[case]()
        return ("no error", repr(out), time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


@pytest.mark.parametrize(
    "case,text",
    [
        ("dtype", "the dtype differs across the mesh (rank 0: float32, rank 1: float32, rank 2: int32, rank 3: float32)"),
        ("ndim", "the ndim differs across the mesh (rank 0: 2, rank 1: 3, rank 2: 2, rank 3: 2)"),
        ("fails_on_three", "the shape= argument differs across the mesh (rank 0: (8, 3), rank 1: (9, 3)"),
        ("placements", "the placements differs across the mesh (rank 0: [Replicate()], rank 1: [Shard(dim=0)]"),
        ("divergent_on_one_dim", "Replicate() on mesh dim 1 but ranks [2, 3] hold different data"),
    ],
)
def test_run_check_raises_the_same_error_on_every_rank(pool4: RankPool, case: str, text: str) -> None:
    results = pool4.run(_run_check, case, timeout=30)
    messages = {msg for _, msg, _ in results}
    assert len(messages) == 1, messages
    for rank, (kind, msg, seconds) in enumerate(results):
        assert kind == "ValueError" and text in msg, f"rank {rank}: {kind}: {msg}"
        assert seconds < 1.0


def test_run_check_accepts_uneven_shards_with_shape(pool4: RankPool) -> None:
    for kind, out, _ in pool4.run(_run_check, "uneven_with_shape_ok"):
        assert kind == "no error" and out == repr([0.0, 0.0, 1.0, 1.0, 2.0, 2.0])  # torch.chunk: 2, 2, 2, 0


# ---------------------------------------------------------------- NaN through Partial max/min
def _nan_partial(rank: int, world: int) -> list[Any]:
    import torch

    from hp_dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    out = []
    for op in ("max", "min"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            local = torch.tensor([1.0, 2.0, -3.0, float(rank)], dtype=dtype)
            if rank == 2:
                local[1] = float("nan")
            if rank == 3:
                local[3] = float("inf") if op == "max" else -float("inf")
            d = DTensor.from_local(local, mesh, [Partial(op)])
            rep = d.redistribute(mesh, [Replicate()]).to_local()
            sh = d.redistribute(mesh, [Shard(0)]).full_tensor()
            out.append((op, str(dtype), rep.tolist(), sh.tolist()))
    return out


def test_partial_max_min_propagate_nan_everywhere(pool4: RankPool) -> None:
    results = pool4.run(_nan_partial)
    for per_rank in results:
        for op, dtype, rep, sh in per_rank:
            for vals in (rep, sh):
                assert vals[0] == 1.0 and vals[2] == -3.0, (op, dtype, vals)
                assert vals[1] != vals[1], f"{op} {dtype}: NaN dropped: {vals}"  # NaN
                assert vals[3] == (float("inf") if op == "max" else -float("inf")), (op, dtype, vals)


# ---------------------------------------------------------------- uneven sharding like torch
def _uneven_like_torch(rank: int, world: int) -> list[Any]:
    import torch
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from hp_dtensor.platform.torch import DTensor

    out = []
    for shape_m in ((4,), (2, 2)):
        ours, theirs = init_device_mesh("cpu", shape_m), torch_mesh("cpu", shape_m)
        for gshape, pl in (
            ((5, 3), [Shard(0)]), ((3, 7), [Shard(1)]), ((1,), [Shard(0)]),
            ((6, 2), [Shard(0), Shard(0)]), ((5, 3), [Shard(1), Shard(0)]), ((3,), [Replicate(), Shard(0)]),
        ):
            if len(pl) != len(shape_m):
                pl = pl[:1] if len(shape_m) == 1 else pl + [Replicate()]
            x = torch.arange(float(torch.Size(gshape).numel())).reshape(gshape)
            mine = x if rank == 0 else torch.zeros_like(x)  # src_data_rank=0 scatters rank 0's data
            d = distribute_tensor(mine, ours, pl)
            t = tdt.distribute_tensor(x, theirs, [tdt.Shard(p.dim) if isinstance(p, Shard) else tdt.Replicate() for p in pl])
            back = DTensor.from_local(d.to_local(), ours, pl, shape=gshape)
            out.append(
                (
                    shape_m, gshape, torch.equal(d.to_local(), t.to_local()), torch.equal(d.full_tensor(), x),
                    torch.equal(back.full_tensor(), x), tuple(d.to_local().shape) == tuple(t.to_local().shape),
                )
            )
    return out


def test_uneven_distribute_from_local_full_tensor_match_torch(pool4: RankPool) -> None:
    for per_rank in pool4.run(_uneven_like_torch):
        for shape_m, gshape, same_local, full_ok, back_ok, same_shape in per_rank:
            assert same_local and same_shape and full_ok and back_ok, (shape_m, gshape)
