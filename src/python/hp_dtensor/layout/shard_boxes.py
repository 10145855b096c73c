"""Which part of a DTensor each rank writes to, and reads from, a sharded checkpoint.

A checkpoint stores every tensor as boxes (offsets and sizes in the global tensor): each rank
holds one box, the one ``local_shape_and_offset`` gives for its mesh coordinate (nested
``Shard`` of one tensor dim and uneven ``torch.chunk`` splits included: a shard is always one
contiguous box).  Ranks that differ only along ``Replicate`` mesh dims hold the same box, so
exactly one of them writes it; the writer is picked by a stable hash of the tensor's key so that
replicated tensors spread over the replicas instead of all landing on one rank.  Empty boxes
are not written unless the whole tensor is empty (then one rank writes it, so the key exists).
``Partial`` values are not a tensor yet: they are refused, naming the tensor.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from hp_dtensor.layout.shard_geometry import local_shape_and_offset
from hp_dtensor.placement_types import Partial, Placement, Replicate


class CheckpointError(ValueError):
    """A checkpoint does not fit the state dict it is loaded into, or cannot be written."""


@dataclass(frozen=True)
class ShardBox:
    """One rank's region of a global tensor: ``offsets`` of its first element and ``sizes``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def check_no_partial(key: str, placements: Sequence[Placement]) -> None:
    """Raise ``CheckpointError`` naming ``key`` when a placement is ``Partial`` (pending reduction)."""
    bad = [k for k, p in enumerate(placements) if isinstance(p, Partial)]
    if bad:
        raise CheckpointError(
            f"checkpoint: DTensor {key!r} has Partial placements {tuple(placements)} on mesh dims {bad}: "
            f"its value is a pending reduction, not a tensor; redistribute it to Replicate() or "
            f"Shard(d) (e.g. t.redistribute(placements=[Replicate()] * mesh.ndim)) before saving or loading"
        )


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> ShardBox:
    """The box of the global tensor held at ``coordinate``."""
    sizes, offsets = local_shape_and_offset(global_shape, mesh_shape, placements, coordinate)
    return ShardBox(offsets=offsets, sizes=sizes)


def replica_writer(key: str, mesh_shape: Sequence[int], placements: Sequence[Placement]) -> tuple[int, ...]:
    """The index along each ``Replicate`` mesh dim (0 elsewhere) of the replica that writes
    ``key``: the same on every rank, spread over replicas by a stable hash of the key."""
    h = zlib.crc32(key.encode("utf-8"))
    index = []
    for k, p in enumerate(placements):
        if isinstance(p, Replicate):
            index.append(h % mesh_shape[k])
            h //= mesh_shape[k]
        else:
            index.append(0)
    return tuple(index)


def writes_box(
    key: str,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> bool:
    """True when the rank at ``coordinate`` writes its box of ``key`` (see the module doc)."""
    check_no_partial(key, placements)
    writer = replica_writer(key, mesh_shape, placements)
    for k, p in enumerate(placements):
        if isinstance(p, Replicate) and coordinate[k] != writer[k]:
            return False
    total = 1
    for s in global_shape:
        total *= s
    if total == 0:  # one rank records the empty tensor: the coordinate of the replica writer, shard index 0
        return all(coordinate[k] == writer[k] for k in range(len(placements)))
    return shard_box(global_shape, mesh_shape, placements, coordinate).numel > 0
