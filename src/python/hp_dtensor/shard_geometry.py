"""Pure geometry of even sharding: local shapes and offsets on a mesh coordinate.

Mesh dims shard in order: when several mesh dims shard the same tensor dim, the earlier mesh
dim takes the outer (coarser) chunks, as in ``torch.distributed.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hp_dtensor.placement_types import Placement, Shard

if TYPE_CHECKING:
    from hp_dtensor.device_mesh import DeviceMesh


def check_even_sharding(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> None:
    """Raise ``ValueError`` when a sharded dim is not divisible by the mesh dims that shard it."""
    divisor = [1] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            if not 0 <= p.dim < len(global_shape):
                raise ValueError(
                    f"Shard({p.dim}) on mesh dim {mesh_dim} is out of range for a tensor of shape "
                    f"{tuple(global_shape)}"
                )
            divisor[p.dim] *= mesh_shape[mesh_dim]
            if global_shape[p.dim] % divisor[p.dim] != 0:
                raise ValueError(
                    f"tensor dim {p.dim} of size {global_shape[p.dim]} cannot be evenly sharded over "
                    f"mesh dim {mesh_dim} of size {mesh_shape[mesh_dim]} (total {divisor[p.dim]} shards); "
                    f"only even sharding is supported: pad the dim or pick a mesh size that divides it"
                )


def local_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    shape = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] //= mesh_shape[mesh_dim]
    return tuple(shape)


def global_shape(
    local: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Inverse of ``local_shape`` under even sharding."""
    shape = list(local)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh_shape[mesh_dim]
    return tuple(shape)


def local_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """Global index of the first element of the local shard held at ``coordinate``."""
    offset = [0] * len(global_shape)
    size = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            size[p.dim] //= mesh_shape[mesh_dim]
            offset[p.dim] += coordinate[mesh_dim] * size[p.dim]
    return tuple(offset)


def check_equal_shard_shapes(rows: Sequence[Sequence[int]], mesh: DeviceMesh) -> None:
    """``rows[i]`` is (local shape..., ndim) of the mesh's i-th rank (row-major); raise
    ``ValueError`` naming every rank's shape unless all are equal (``from_local(run_check=True)``)."""
    if all(list(r) == list(rows[0]) for r in rows):
        return
    detail = ", ".join(f"rank {rank}: {tuple(r[:-1])}" for rank, r in zip(mesh.layout.ranks, rows))
    raise ValueError(
        f"from_local(run_check=True): local shards differ across the mesh ({detail}); "
        f"only even sharding is supported"
    )
