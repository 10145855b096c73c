"""Which ranks share a parameter: the data-parallel mesh of ``fully_shard`` and, for a parameter
that tensor parallelism already split, the mesh its sharded form lives on.

The data-parallel mesh is 1-D (FSDP: shard over every rank of it) or 2-D
``(replicate, shard)`` (HSDP: shard inside a group, replicate across groups).  A TP parameter is
gathered and reduced over the data-parallel dims only; its sharded form is a DTensor over the TP
dims followed by the data-parallel dims, so its placements read left to right as torch's do:
first the TP split, then ``Shard(0)`` of that TP shard over the data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hp_dtensor import DeviceMesh, Partial, Placement, Replicate, Shard
from hp_dtensor.platform import current as _platform


@dataclass(frozen=True)
class FSDPMeshInfo:
    """The data-parallel mesh and this rank's view of it."""

    mesh: DeviceMesh

    def __post_init__(self) -> None:
        if self.mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard takes a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got a "
                f"{self.mesh.ndim}-D mesh {self.mesh}; pass the data-parallel slice, e.g. mesh['dp']"
            )
        if self.mesh.get_coordinate() is None:
            raise ValueError(f"rank {self.mesh.get_rank()} is not part of the fully_shard mesh {self.mesh}")

    @property
    def shard_dim(self) -> int:
        return self.mesh.ndim - 1

    @property
    def is_hybrid(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_dim)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_dim)

    @property
    def shard_group(self) -> Any:
        return self.mesh.get_group(self.shard_dim)

    @property
    def replicate_size(self) -> int:
        return self.mesh.size(0) if self.is_hybrid else 1

    @property
    def replicate_group(self) -> Any:
        return self.mesh.get_group(0) if self.is_hybrid else None

    @property
    def dp_size(self) -> int:
        return self.mesh.size()

    def dp_placements(self) -> tuple[Placement, ...]:
        """The placements of a sharded parameter over the data-parallel dims."""
        return (Replicate(), Shard(0)) if self.is_hybrid else (Shard(0),)


def sharded_layout(
    info: FSDPMeshInfo, fqn: str, tp_mesh: DeviceMesh | None, tp_placements: tuple[Placement, ...]
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """Mesh and placements of the sharded form of parameter ``fqn`` (``tp_mesh`` None: a plain one)."""
    if tp_mesh is None:
        return info.mesh, info.dp_placements()
    if any(isinstance(p, Partial) for p in tp_placements):
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a Partial DTensor {tp_placements}; a parameter must be "
            f"Shard or Replicate on its mesh"
        )
    tp_names, dp_names = tp_mesh.mesh_dim_names, info.mesh.mesh_dim_names
    root = tp_mesh.get_root_mesh()
    if tp_names is None or dp_names is None or root != info.mesh.get_root_mesh():
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor on {tp_mesh}, which is not a named slice of the "
            f"same mesh as the fully_shard mesh {info.mesh}; slice both from one init_device_mesh "
            f"(e.g. mesh['tp'] for parallelize_module and mesh['dp'] for fully_shard)"
        )
    shared = set(tp_names) & set(dp_names)
    if shared:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is already split over mesh dim(s) {sorted(shared)}, which the "
            f"fully_shard mesh {info.mesh} also uses; pass only the data-parallel dims to fully_shard"
        )
    return root[tuple(tp_names) + tuple(dp_names)], tuple(tp_placements) + info.dp_placements()


@dataclass(frozen=True)
class PostForwardGroup:
    """Where a group with ``reshard_after_forward=<int>`` keeps its parameters between forward and
    backward: this rank's group of ``size`` consecutive ranks of its shard group (``ranks``, the
    process ``group``), and its ``index`` in it.  Ranks at the same index of different groups hold
    the same ``1/size`` of the gathered parameters; backward gathers them back over ``group``."""

    size: int
    ranks: tuple[int, ...]
    index: int
    group: Any


def post_forward_group(info: FSDPMeshInfo, size: int) -> PostForwardGroup:
    """Split every shard group of the data-parallel mesh into groups of ``size`` consecutive ranks
    (torch's ``mesh.view(-1, size)``; ``size`` divides the shard group's size) and return this
    rank's.  Creating a process group is collective over the world, so every rank creates every
    group -- those of the data-parallel meshes the other slices of the root mesh hold too -- in one
    order."""
    mesh = info.mesh
    root = mesh.get_root_mesh()
    if root is mesh or mesh.mesh_dim_names is None:
        slices = [mesh.layout.ranks]
    else:
        dims = [root.layout.dim_index(name) for name in mesh.mesh_dim_names]
        found: dict[tuple[int, ...], None] = {}
        for r in root.layout.ranks:
            found.setdefault(root.layout.submesh(dims, r).ranks, None)
        slices = list(found)
    groups = [ranks[i : i + size] for ranks in slices for i in range(0, len(ranks), size)]
    plat = _platform()
    for ranks in groups:
        plat.get_or_create_group(ranks)
    me = mesh.get_rank()
    mine = next(ranks for ranks in groups if me in ranks)
    return PostForwardGroup(size=size, ranks=mine, index=mine.index(me), group=plat.get_or_create_group(mine))
