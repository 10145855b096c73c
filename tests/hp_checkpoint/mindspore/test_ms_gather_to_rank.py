# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,method-assign,assignment"
"""Gathering a tensor whole onto one rank on MindSpore (mccl, which has no point-to-point): each
box moves by a broadcast inside the group of its holder and the destination, created on demand by
those two ranks.  On 4 ranks (pairs that overlap, created in the planned order) every placement
combination of a 2-d mesh, uneven and empty shards, scalars, plain tensors, float32, bfloat16,
float16 and int64 reach every destination bit for bit, other ranks get nothing, and no rank outside
a pair takes part in its transfer (counted: broadcasts per rank equal the boxes it sends or
receives).  A failing rank is refused on every rank."""

from __future__ import annotations

from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(4, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
DTYPES = ("float32", "bfloat16", "int64", "float16")


def _cases() -> list[tuple[str, tuple[int, ...], str, tuple[str, str]]]:
    import itertools

    shapes = [(5, 3), (4, 6), (1, 7), (0, 3), (3,), ()]
    out: list[tuple[str, tuple[int, ...], str, tuple[str, str]]] = []
    for shape in shapes:
        for a, b in itertools.product(["R", "S0", "S1"], repeat=2):
            if (a == "S1" or b == "S1") and len(shape) < 2 or (a != "R" or b != "R") and not shape:
                continue
            dtype = DTYPES[len(out) % len(DTYPES)]
            out.append((f"{shape}-{a}{b}-{dtype}", shape, dtype, (a, b)))
    return out


def _bits(t: Any) -> Any:
    """The tensor's exact bit patterns as numpy (bfloat16 widened to float32 exactly, then viewed)."""
    import mindspore as ms
    import numpy as np

    a = t.astype(ms.float32).asnumpy() if t.dtype == ms.bfloat16 else t.asnumpy()
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)


def _gather_cases(rank: int, world: int) -> dict[str, Any]:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    from hp_checkpoint.gather_to_rank import gather_to, plan_sources
    from hp_dtensor import CommDebugMode, Replicate, Shard, distribute_tensor, init_device_mesh

    ms_dtypes = {"float32": ms.float32, "bfloat16": ms.bfloat16, "int64": ms.int64, "float16": ms.float16}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    place = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    rs = np.random.RandomState(7)
    state: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    for name, shape, dtype, (a, b) in _cases():
        values = rs.standard_normal(shape).astype(np.float32) * 100
        if dtype == "float32" and values.size:
            values.reshape(-1)[0] = -0.0  # signed zeros cross bit for bit
        full = Tensor(values).astype(ms_dtypes[dtype])
        expected[name] = full
        state[name] = distribute_tensor(full, mesh, [place[a], place[b]])
    state["plain"] = expected["plain"] = Tensor(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    checked = 0
    moved = 0  # boxes this rank sent or received
    counts: dict[str, int] = {}
    for dst in range(world):
        dst_of = {k: dst for k in state}
        with CommDebugMode() as comm:
            sources = plan_sources(state, dst_of)
            for key in state:
                got = gather_to(state[key], sources[key], dst)
                moved += sum(1 for _box, src in sources[key].senders if src != dst and rank in (src, dst))
                if rank == dst:
                    assert got is not None and got.dtype == expected[key].dtype, key
                    assert tuple(got.shape) == tuple(expected[key].shape), key
                    assert np.array_equal(_bits(got), _bits(expected[key])), key
                    checked += 1
                else:
                    assert got is None
        for k, v in comm.get_comm_counts().items():
            counts[str(k)] = counts.get(str(k), 0) + v
    return {"checked": checked, "tensors": len(state), "moved": moved, "counts": counts}


def test_gather_every_placement_to_every_rank(ms_pool: RankPool) -> None:
    results = ms_pool.run(_gather_cases)
    per_dst = results[0]["tensors"]
    assert [r["checked"] for r in results] == [per_dst] * 4
    for rank, r in enumerate(results):
        # one broadcast per box this rank sends or receives: a rank outside a pair never joins it
        assert r["counts"].get("broadcast", 0) == r["moved"] > 0, (rank, r)
        assert set(r["counts"]) <= {"broadcast", "all_gather_object"}, (rank, r["counts"])
    print(f"{per_dst} tensors gathered to each of 4 MindSpore ranks; boxes moved per rank "
          f"{[r['moved'] for r in results]}")


def _export_failing(rank: int, world: int, folder: str, what: str) -> str:
    import numpy as np
    from mindspore import Tensor

    from hp_checkpoint.hf_export import export_hf_safetensors
    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    state = {f"w{i}": distribute_tensor(Tensor(np.full((8, 4), i, np.float32)), mesh, [Shard(0)]) for i in range(6)}

    def convert(parts: dict[str, Any]) -> dict[str, Any]:
        if what == "convert" and "w3" in parts:
            raise ValueError("conversion bug")
        return parts

    from hp_checkpoint.platform.mindspore.shard_files import SHARD_FILES

    real_write = SHARD_FILES.write

    def failing_write(tensors: Any, file: str) -> None:
        if rank == 2:
            raise OSError(28, "No space left on device")
        real_write(tensors, file)

    if what == "write":
        SHARD_FILES.write = failing_write
    try:
        export_hf_safetensors(state, folder, groups={k: [k] for k in state}, convert=convert)
    except RuntimeError as e:
        return str(e)
    finally:
        if what == "write":
            del SHARD_FILES.write
    return "no error"


def test_a_failing_rank_is_raised_on_every_rank(ms_pool: RankPool, tmp_path) -> None:
    import os

    for what, match in (("convert", "converting 'w3': ValueError: conversion bug"),
                        ("write", "rank 2 could not write model-")):
        folder = str(tmp_path / what)
        for msg in ms_pool.run(_export_failing, folder, what):
            assert match in msg, (what, msg)
        assert not os.path.exists(os.path.join(folder, "model.safetensors.index.json")), what
