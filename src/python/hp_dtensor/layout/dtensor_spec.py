"""``DTensorSpec``: what a DTensor is besides its local data -- mesh, placements, global shape.

Framework-neutral, shared by every platform's DTensor; dispatch uses specs as cache keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.layout.shard_geometry import check_even_sharding, check_shard_dims, global_shape, local_shape
from hp_dtensor.placement_types import Partial, Placement, Replicate, normalize_placements


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
        """Shape of this rank's shard (uneven layouts give trailing ranks smaller shards)."""
        coord = self.mesh.get_coordinate()
        return local_shape(self.shape, self.mesh.shape, self.placements, coord)


# The argument rules of the DTensor API, shared by every backend so that the same call fails the
# same way on torch and MindSpore.
def _check_layout(shape: Sequence[int], mesh: DeviceMesh, pl: tuple[Placement, ...], uneven: bool) -> None:
    """Shard dims in range; and equal shards everywhere for a backend without uneven support."""
    if uneven:
        check_shard_dims(shape, pl)
    else:
        check_even_sharding(shape, mesh.shape, pl)


def redistribute_target(
    spec: DTensorSpec,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | Placement | None,
    *,
    uneven: bool = False,
) -> tuple[Placement, ...]:
    """The placements ``redistribute(device_mesh, placements)`` asks for, checked (``uneven``: the
    backend supports ``torch.chunk``-style uneven shards)."""
    mesh = device_mesh or spec.mesh
    if mesh != spec.mesh:
        raise ValueError(f"redistribute across meshes is not supported: tensor is on {spec.mesh}, target {mesh}")
    if placements is None:
        raise ValueError("redistribute needs placements, e.g. placements=[Replicate()]")
    dst = normalize_placements(placements, mesh.ndim, len(spec.shape))
    _check_layout(spec.shape, mesh, dst, uneven)
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
    *,
    uneven: bool = False,
) -> DTensorSpec:
    """The spec ``from_local`` gives a shard of shape ``local``: global shape inferred under even
    sharding (as torch does), or ``shape`` -- which may shard unevenly -- checked against this
    rank's shard."""
    lshape = tuple(int(s) for s in local)
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, mesh.ndim, len(lshape))
    if shape is None:
        return DTensorSpec(mesh, pl, global_shape(lshape, mesh.shape, pl))
    gshape = tuple(int(s) for s in shape)
    if len(gshape) != len(lshape) or any(s < 0 for s in gshape):
        raise ValueError(f"shape={gshape} does not fit a local tensor of {len(lshape)} dims {lshape}")
    _check_layout(gshape, mesh, pl, uneven)
    want = local_shape(gshape, mesh.shape, pl, mesh.get_coordinate())
    if want != lshape:
        raise ValueError(
            f"local shape {lshape} on rank {mesh.get_rank()} does not match global shape {gshape} with "
            f"placements {pl} on mesh {mesh.shape}: this rank's shard should be {want}"
        )
    return DTensorSpec(mesh, pl, gshape)


def distribute_placements(
    global_shape_: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement] | Placement | None,
    *,
    uneven: bool = False,
) -> tuple[Placement, ...]:
    """The placements ``distribute_tensor`` lays a tensor of ``global_shape_`` out with, checked."""
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, mesh.ndim, len(global_shape_))
    _check_layout(global_shape_, mesh, pl, uneven)
    return pl


def is_floating_dtype(dtype: str) -> bool:
    """Whether ``dtype``, named as its framework prints it (``torch.bfloat16``, ``Float32``,
    ``torch.complex64``...), holds floating-point or complex values; both frameworks spell those
    names with ``float`` / ``complex`` and no integer or bool dtype does."""
    name = dtype.lower()
    return "float" in name or "complex" in name


def check_partial_dtype(placements: Sequence[Placement], dtype: str) -> None:
    """``Partial("avg")`` divides by the mesh size: refuse it on integer and bool tensors, where
    the division cannot be represented."""
    if not is_floating_dtype(dtype) and any(isinstance(p, Partial) and p.reduce_op == "avg" for p in placements):
        raise ValueError(
            f"Partial('avg') needs a floating-point tensor, got dtype {dtype}: the average of integer "
            f"partial values is not an integer; use Partial('sum') or convert the tensor to float first"
        )


def check_src_data_rank(src_data_rank: object, mesh: DeviceMesh) -> None:
    """``src_data_rank`` is the group rank that holds the data on every mesh dim (or None)."""
    if src_data_rank is None:
        return
    if not isinstance(src_data_rank, int) or isinstance(src_data_rank, bool):
        raise TypeError(f"src_data_rank must be an int or None, got {src_data_rank!r}")
    if not 0 <= src_data_rank < min(mesh.shape):
        raise ValueError(
            f"src_data_rank={src_data_rank} is not a group rank on every dim of mesh shape {mesh.shape}: "
            f"it names the source rank within each mesh dim, so it must be in [0, {min(mesh.shape)}); "
            f"use 0 (the default) or None (every rank slices its own copy)"
        )
