"""``DTensorSpec``: what a DTensor is besides its local data -- mesh, placements, global shape.

Framework-neutral, shared by every platform's DTensor; dispatch uses specs as cache keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.placement_types import Placement, Replicate, normalize_placements
from hp_dtensor.shard_geometry import check_even_sharding, global_shape, local_shape


class DTensorSpec:
    """Mesh, placements and global shape of a DTensor; immutable, with its hash computed once
    because dispatch uses specs as cache keys on every op."""

    __slots__ = ("mesh", "placements", "shape", "_hash")

    def __init__(self, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> None:
        self.mesh = mesh
        self.placements = placements
        self.shape = shape
        self._hash = hash((mesh, placements, shape))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, DTensorSpec)
            and self._hash == other._hash
            and self.placements == other.placements
            and self.shape == other.shape
            and self.mesh == other.mesh
        )

    def __repr__(self) -> str:
        return f"DTensorSpec({self.mesh}, {self.placements}, {self.shape})"

    def local_shape(self) -> tuple[int, ...]:
        return local_shape(self.shape, self.mesh.shape, self.placements)


# The argument rules of the DTensor API, shared by every backend so that the same call fails the
# same way on torch and MindSpore.
def redistribute_target(
    spec: DTensorSpec, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | Placement | None
) -> tuple[Placement, ...]:
    """The placements ``redistribute(device_mesh, placements)`` asks for, checked."""
    mesh = device_mesh or spec.mesh
    if mesh != spec.mesh:
        raise ValueError(f"redistribute across meshes is not supported: tensor is on {spec.mesh}, target {mesh}")
    if placements is None:
        raise ValueError("redistribute needs placements, e.g. placements=[Replicate()]")
    dst = normalize_placements(placements, mesh.ndim, len(spec.shape))
    check_even_sharding(spec.shape, mesh.shape, dst)
    return dst


def resolve_mesh(device_mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    """``device_mesh``, else the mesh of an enclosing ``with mesh:``."""
    from hp_dtensor.device_mesh import get_current_mesh

    mesh = device_mesh or get_current_mesh()
    if mesh is None:
        raise ValueError(f"{what} needs a device_mesh (or an active `with mesh:`)")
    return mesh


def from_local_spec(
    local: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement] | Placement | None,
    shape: Sequence[int] | None,
) -> DTensorSpec:
    """The spec ``from_local`` gives a shard of shape ``local``: global shape inferred under even
    sharding, or ``shape`` checked against it."""
    lshape = tuple(int(s) for s in local)
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, mesh.ndim, len(lshape))
    if shape is None:
        return DTensorSpec(mesh, pl, global_shape(lshape, mesh.shape, pl))
    gshape = tuple(int(s) for s in shape)
    check_even_sharding(gshape, mesh.shape, pl)
    if local_shape(gshape, mesh.shape, pl) != lshape:
        raise ValueError(
            f"local shape {lshape} does not match global shape {gshape} with placements {pl} on mesh {mesh.shape}"
        )
    return DTensorSpec(mesh, pl, gshape)


def distribute_placements(
    global_shape_: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement] | Placement | None
) -> tuple[Placement, ...]:
    """The placements ``distribute_tensor`` lays a tensor of ``global_shape_`` out with, checked."""
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, mesh.ndim, len(global_shape_))
    check_even_sharding(global_shape_, mesh.shape, pl)
    return pl
