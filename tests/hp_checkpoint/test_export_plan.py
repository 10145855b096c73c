"""The export plan: writers balanced by bytes within ``total / world + largest``, each tensor in
exactly one file of its writer, files numbered HF-style over all ranks, shard cuts honoured."""

from __future__ import annotations

import random

import pytest

from hp_checkpoint.export_plan import assign_by_bytes, plan_export


def _cases(n: int) -> list[tuple[dict[str, int], int, int | None]]:
    rng = random.Random(1515)
    out = []
    for _ in range(n):
        sizes = {f"t{i}": rng.choice([0, 4, 64, 1000, rng.randint(1, 10**6)]) for i in range(rng.randint(1, 40))}
        world = rng.randint(1, 9)
        cut = rng.choice([None, rng.randint(1, 2 * 10**6)])
        out.append((sizes, world, cut))
    return out


CASES = _cases(300)


def test_plans_on_seeded_cases() -> None:
    for sizes, world, cut in CASES:
        plan = plan_export(sizes, world, max_shard_bytes=cut)
        total, largest = sum(sizes.values()), max(sizes.values())
        # balance: the longest-processing-time bound
        assert all(a <= total / world + largest for a in plan.assigned), (sizes, world, plan.assigned)
        assert sum(plan.assigned) == total
        # every tensor in exactly one file, written by its writer
        seen = [t for f in plan.files for t in f.tensors]
        assert sorted(seen) == sorted(sizes)
        for f in plan.files:
            assert all(plan.writer[t] == f.rank for t in f.tensors)
            assert f.nbytes == sum(sizes[t] for t in f.tensors)
            if cut is not None and len(f.tensors) > 1:
                assert f.nbytes <= cut  # only a single tensor larger than the cut may exceed it
        n = len(plan.files)
        assert [f.name for f in plan.files] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        index = plan.index_json()
        assert index["metadata"]["total_size"] == total
        assert list(index["weight_map"]) == sorted(sizes)
        assert plan_export(sizes, world, max_shard_bytes=cut) == plan  # every rank computes the same plan
    print(f"{len(CASES)} seeded export plans checked")


def test_largest_first_balances_exactly_when_it_can() -> None:
    assert assign_by_bytes({"a": 6, "b": 5, "c": 4, "d": 3, "e": 2}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}


def test_order_decides_file_contents() -> None:
    plan = plan_export({"x": 1, "y": 1, "z": 1}, 1, order=["z", "x", "y"])
    assert plan.files[0].tensors == ("z", "x", "y")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sizes": {}, "world": 2}, "nothing to export"),
        ({"sizes": {"a": 1}, "world": 0}, "world must be >= 1, got 0"),
        ({"sizes": {"a": -1}, "world": 1}, r"negative byte sizes \{'a': -1\}"),
        ({"sizes": {"a": 1}, "world": 1, "max_shard_bytes": 0}, "max_shard_bytes must be positive, got 0"),
        ({"sizes": {"a": 1, "b": 2}, "world": 1, "order": ["a"]}, "order must list every tensor exactly once"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    sizes, world = kwargs.pop("sizes"), kwargs.pop("world")
    with pytest.raises(ValueError, match=match):
        plan_export(sizes, world, **kwargs)
