"""``FSDPParam``: one parameter's sharded form (what the optimizer sees) and its unsharded form
(what forward and backward compute with), and the rows of it this rank owns.

Dim 0 of the parameter -- of its TP shard, for a TP parameter -- is split ``torch.chunk``-style
over the shard group: every rank contributes ``chunk_rows`` rows to each collective, the last
ranks padding past the end, so uneven dims never show in the sharded parameter's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_dtensor import DeviceMesh, Placement
from hp_dtensor.layout.shard_geometry import chunk_size, chunk_size_and_offset
from hp_fsdp.mesh_info import FSDPMeshInfo, sharded_layout
from hp_fsdp.primitives import FSDPPrimitives, Tensor


@dataclass
class FSDPParam:
    """A parameter managed by one ``fully_shard`` group; ``owners`` are every (module, name) that
    holds it (tied parameters have several), all swapped together."""

    fqn: str
    owners: list[tuple[object, str]]
    sharded_param: Tensor
    requires_grad: bool
    orig_dtype: object
    global_shape: tuple[int, ...]
    unsharded_shape: tuple[int, ...]  # the TP shard's shape (the whole tensor without TP)
    chunk_rows: int
    shard_shape: tuple[int, ...]
    tp_mesh: DeviceMesh | None
    tp_placements: tuple[Placement, ...]
    unsharded_param: Tensor | None = None
    unsharded_local: Tensor | None = None


def make_fsdp_param(
    prims: FSDPPrimitives, info: FSDPMeshInfo, fqn: str, owners: list[tuple[object, str]], param: Tensor,
    offload_device: object | None, pin: bool,
) -> FSDPParam:
    """Cut this rank's rows out of ``param`` and build its sharded parameter."""
    tp_mesh: DeviceMesh | None = None
    tp_placements: tuple[Placement, ...] = ()
    if prims.is_dtensor(param):
        tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    local = prims.local_of(param)
    unsharded_shape = prims.shape_of(local)
    if not unsharded_shape:
        raise ValueError(
            f"fully_shard shards dim 0 of every parameter, but {fqn!r} is a scalar (0-d); "
            f"pass it in ignored_params or make it 1-D"
        )
    mesh, placements = sharded_layout(info, fqn, tp_mesh, tp_placements)
    n = info.shard_size
    length, start = chunk_size_and_offset(unsharded_shape[0], n, info.shard_rank)
    shard = prims.rows(local, start, length)
    if offload_device is not None:
        shard = prims.to_device(shard, offload_device, pin=pin)
    global_shape = prims.shape_of(param)
    requires_grad = bool(param.requires_grad)
    sharded = prims.new_param(prims.wrap(shard, mesh, placements, global_shape), requires_grad)
    prims.name_param(sharded, param)  # MindSpore keys optimizers and checkpoints by name
    return FSDPParam(
        fqn=fqn, owners=owners, sharded_param=sharded, requires_grad=requires_grad,
        orig_dtype=prims.dtype_of(param), global_shape=global_shape, unsharded_shape=unsharded_shape,
        chunk_rows=chunk_size(unsharded_shape[0], n), shard_shape=(length,) + unsharded_shape[1:],
        tp_mesh=tp_mesh, tp_placements=tp_placements,
    )
