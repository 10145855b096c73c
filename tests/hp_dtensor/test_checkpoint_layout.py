"""Which rank writes which box of a sharded checkpoint (pure geometry, one process): over every
layout of small tensors on small meshes, the written boxes are exactly the distinct non-empty
shards, each written once by a rank holding it, tiling the tensor; Partial is refused by name."""

from __future__ import annotations

import itertools
import random

import pytest

from hp_dtensor.layout.shard_boxes import CheckpointError, replica_writer, shard_box, writes_box
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard


def _layouts(ndim: int, mesh_ndim: int) -> list[tuple[Placement, ...]]:
    choices: list[Placement] = [Replicate(), *[Shard(d) for d in range(ndim)]]
    return [tuple(p) for p in itertools.product(choices, repeat=mesh_ndim)]


def test_written_boxes_tile_the_tensor_once(capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(0)
    cases = 0
    for mesh_shape in ((4,), (2, 2), (2, 3), (3, 1, 2)):
        coords = list(itertools.product(*[range(m) for m in mesh_shape]))
        for ndim in (0, 1, 2, 3):
            for pl in _layouts(ndim, len(mesh_shape)):
                shape = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 9) for _ in range(ndim))
                key = f"k{cases}"
                covered: dict[tuple[int, ...], int] = {}
                written = set()
                for c in coords:
                    if not writes_box(key, shape, mesh_shape, pl, c):
                        continue
                    box = shard_box(shape, mesh_shape, pl, c)
                    assert (box.offsets, box.sizes) not in written, (shape, pl, c)
                    written.add((box.offsets, box.sizes))
                    for idx in itertools.product(*[range(o, o + s) for o, s in zip(box.offsets, box.sizes)]):
                        covered[idx] = covered.get(idx, 0) + 1
                everything = set(itertools.product(*[range(s) for s in shape]))
                assert set(covered) == everything and set(covered.values()) <= {1}, (shape, pl)
                numel = len(everything) if ndim else 1
                assert written or numel == 0, (shape, pl)
                if any(s == 0 for s in shape):
                    assert len(written) == 1, (shape, pl, written)  # the key must exist in the checkpoint
                cases += 1
    with capsys.disabled():
        print(f"\ncheckpoint writer geometry: {cases} layouts checked, each tiled once")
    assert cases == 170


def test_replicated_tensors_spread_over_replicas() -> None:
    writers = {replica_writer(f"layers.{i}.norm.weight", (4,), (Replicate(),)) for i in range(40)}
    assert writers == {(0,), (1,), (2,), (3,)}


@pytest.mark.parametrize("pl", [(Partial(),), (Shard(0), Partial("max"))])
def test_partial_is_refused_by_name(pl: tuple[Placement, ...]) -> None:
    mesh = (4,) if len(pl) == 1 else (2, 2)
    with pytest.raises(CheckpointError, match=r"'grad\.acc' has Partial.*redistribute"):
        writes_box("grad.acc", (4, 4), mesh, pl, (0,) * len(mesh))
