"""The DTensor's answers to ``torch.distributed.checkpoint`` (DCP) extension hooks.

DCP asks a tensor subclass three things: which boxes this rank writes (``__create_write_items__``),
which boxes it needs on load (``__create_chunk_list__``) and the local tensor behind a box
(``__get_tensor_shard__``).  Answering them from the DTensor's spec makes ``dcp.save`` write each
rank's own shard once (replicas deduplicated) and ``dcp.load`` read exactly this rank's slice of
any saved layout, whichever package drives the save.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from hp_dtensor.layout.dtensor_spec import DTensorSpec
from hp_dtensor.layout.shard_boxes import CheckpointError, ShardBox, check_no_partial, shard_box, writes_box


def _box(spec: DTensorSpec) -> ShardBox | None:
    coord = spec.mesh.get_coordinate()
    if coord is None:  # this rank is outside the DTensor's mesh: it holds nothing
        return None
    return shard_box(spec.shape, spec.mesh.shape, spec.placements, coord)


def create_write_items(local: torch.Tensor, spec: DTensorSpec, fqn: str) -> list[WriteItem]:
    """The one box this rank writes for ``fqn``, or none (another replica writes it, or it is empty)."""
    coord = spec.mesh.get_coordinate()
    if coord is None or not writes_box(fqn, spec.shape, spec.mesh.shape, spec.placements, coord):
        return []
    box = shard_box(spec.shape, spec.mesh.shape, spec.placements, coord)
    offsets = torch.Size(box.offsets)
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes)),
                properties=TensorProperties.create_from_tensor(local),
                size=torch.Size(spec.shape),
            ),
        )
    ]


def create_chunk_list(spec: DTensorSpec) -> list[ChunkStorageMetadata]:
    """The box this rank loads (empty boxes overlap nothing, so they read nothing)."""
    check_no_partial("<being loaded>", spec.placements)
    box = _box(spec)
    if box is None:
        return []
    return [ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))]


def get_tensor_shard(local: torch.Tensor, spec: DTensorSpec, index: MetadataIndex) -> torch.Tensor:
    """The local tensor holding the box that starts at ``index.offset``."""
    box = _box(spec)
    if box is None or (index.offset is not None and tuple(index.offset) != box.offsets):
        raise CheckpointError(
            f"checkpoint: {index.fqn!r} has no local shard at offset {index.offset} on this rank "
            f"(its shard starts at {None if box is None else box.offsets})"
        )
    return local
