"""``DTensorSpec``: what a DTensor is besides its local data -- mesh, placements, global shape.

Framework-neutral, shared by every platform's DTensor; dispatch uses specs as cache keys.
"""

from __future__ import annotations

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.placement_types import Placement
from hp_dtensor.shard_geometry import local_shape


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
