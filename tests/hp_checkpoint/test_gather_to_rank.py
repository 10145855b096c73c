# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""Gathering a tensor whole onto one rank only: every placement combination of a 2-d mesh,
uneven and empty shards, scalars, plain tensors, bf16 and int64, each destination rank -- the
result equals the tensor the DTensor was made from, other ranks get nothing, and each box crosses
the wire at most once.  Ranks that disagree on a tensor's shape, or Partial values, are refused
on every rank, naming the tensor."""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=180)


def _cases() -> list[tuple[str, tuple[int, ...], str, tuple[Any, ...]]]:
    import itertools

    shapes = [(5, 3), (4, 6), (1, 7), (0, 3), (3,), ()]
    placements = ["R", "S0", "S1"]
    out: list[tuple[str, tuple[int, ...], str, tuple[Any, ...]]] = []
    for shape in shapes:
        for a, b in itertools.product(placements, repeat=2):
            if (a == "S1" or b == "S1") and len(shape) < 2 or (a != "R" or b != "R") and not shape:
                continue
            dtype = ["float32", "bfloat16", "int64"][len(out) % 3]
            out.append((f"{shape}-{a}{b}-{dtype}", shape, dtype, (a, b)))
    return out


def _gather_cases(rank: int, world: int) -> tuple[int, int, int]:
    import torch

    from hp_checkpoint.gather_to_rank import gather_to, plan_sources
    from hp_checkpoint.platform.torch.transfer import to_dtype
    from hp_dtensor import CommDebugMode, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    place = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    for name, shape, dtype, (a, b) in _cases():
        full = (torch.randn(shape, generator=g) * 100).to(to_dtype(dtype))
        expected[name] = full
        state[name] = distribute_tensor(full, mesh, [place[a], place[b]])
    state["plain"] = expected["plain"] = torch.arange(12.0).reshape(3, 4)[:, ::2]  # non-contiguous, every rank
    checked = sent_total = 0
    for dst in range(world):
        dst_of = {k: dst for k in state}
        with CommDebugMode() as comm:
            sources = plan_sources(state, dst_of)
            for key in state:
                got = gather_to(state[key], sources[key], dst)
                if rank == dst:
                    assert got is not None and got.dtype == expected[key].dtype, key
                    assert torch.equal(got, expected[key]), key
                    checked += 1
                else:
                    assert got is None
        sent = comm.get_comm_bytes().get("send", 0)
        # a rank sends only its own boxes, each at most once, and the destination never sends
        own = sum(state[k].to_local().numel() * state[k].element_size() for k in state if k != "plain")
        assert sent <= own and (rank != dst or sent == 0), (rank, dst, sent, own)
        sent_total += sent
    return checked, sent_total, len(state)


def test_gather_every_placement_to_every_rank(pool4: RankPool) -> None:
    results = pool4.run(_gather_cases)
    per_dst = results[0][2]
    assert [r[0] for r in results] == [per_dst] * 4
    print(f"{per_dst} tensors gathered to each of 4 ranks; bytes sent per rank {[r[1] for r in results]}")


def _disagree(rank: int, world: int) -> str:
    import torch

    from hp_checkpoint.gather_to_rank import plan_sources
    from hp_dtensor.layout.shard_boxes import CheckpointError

    state = {"w": torch.zeros(3 + (rank == 2), 2)}
    try:
        plan_sources(state, {"w": 0})
    except CheckpointError as e:
        return str(e)
    return "no error"


def _partial(rank: int, world: int) -> str:
    import torch

    from hp_checkpoint.gather_to_rank import plan_sources
    from hp_dtensor import DTensor, Partial, init_device_mesh
    from hp_dtensor.layout.shard_boxes import CheckpointError

    t = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (world,)), [Partial()])
    try:
        plan_sources({"loss_sum": t}, {"loss_sum": 1})
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("fn,match", [(_disagree, "tensor 'w' has different global (shape, dtype)"),
                                      (_partial, "'loss_sum' has Partial placements")])
def test_inconsistent_state_is_refused_on_every_rank(pool4: RankPool, fn: Any, match: str) -> None:
    for msg in pool4.run(fn):
        assert match in msg, msg
