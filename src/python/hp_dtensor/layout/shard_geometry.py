"""Pure geometry of sharding: local shapes and offsets on a mesh coordinate, even or not.

``Shard(d)`` splits dim ``d`` like ``torch.chunk``: over ``n`` ranks every chunk has
``ceil(size / n)`` elements except the last non-empty one, and trailing ranks may get 0.  Mesh
dims shard in order: when several mesh dims shard the same tensor dim, each splits what the
earlier ones left (the earlier mesh dim takes the outer, coarser chunks), as in
``torch.distributed.tensor``.  Where a collective needs equal pieces, the plan walker pads to
``ceil(size / n)`` and cuts the padding off again, so it never shows.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.placement_types import Placement, Replicate, Shard


def chunk_size(size: int, n: int) -> int:
    """Size of the first (largest) chunk of a dim of ``size`` split over ``n`` ranks."""
    return -(-size // n)


def chunk_size_and_offset(size: int, n: int, index: int) -> tuple[int, int]:
    """(length, start) of chunk ``index`` of a dim of ``size`` split ``torch.chunk``-style into ``n``."""
    full = chunk_size(size, n)
    start = min(size, full * index)
    return max(0, min(size, full * (index + 1)) - start), start


def check_shard_dims(global_shape: Sequence[int], placements: Sequence[Placement]) -> None:
    """Raise ``ValueError`` when a ``Shard`` names a dim the tensor does not have."""
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard) and not 0 <= p.dim < len(global_shape):
            raise ValueError(
                f"Shard({p.dim}) on mesh dim {mesh_dim} is out of range for a tensor of shape "
                f"{tuple(global_shape)}"
            )


def is_even(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> bool:
    """True when every rank holds a shard of the same shape (each split divides exactly)."""
    size = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            if size[p.dim] % mesh_shape[mesh_dim]:
                return False
            size[p.dim] //= mesh_shape[mesh_dim]
    return True


def check_even_sharding(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> None:
    """Raise ``ValueError`` when a sharded dim is not divisible by the mesh dims that shard it
    (for code that needs equal shards on every rank)."""
    check_shard_dims(global_shape, placements)
    divisor = [1] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            divisor[p.dim] *= mesh_shape[mesh_dim]
            if global_shape[p.dim] % divisor[p.dim] != 0:
                raise ValueError(
                    f"tensor dim {p.dim} of size {global_shape[p.dim]} cannot be evenly sharded over "
                    f"mesh dim {mesh_dim} of size {mesh_shape[mesh_dim]} (total {divisor[p.dim]} shards); "
                    f"this backend needs even shards: pad the dim or pick a mesh size that divides it"
                )


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape of the shard held at ``coordinate`` and the global index of its first element."""
    shape = list(global_shape)
    offset = [0] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            length, start = chunk_size_and_offset(shape[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            shape[p.dim] = length
            offset[p.dim] += start
    return tuple(shape), tuple(offset)


def local_shape(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Shape of the shard at ``coordinate``.  Without a coordinate the layout must be even (the
    shape is then the same on every rank); an uneven one raises ``ValueError``."""
    if coordinate is None:
        if not is_even(global_shape, mesh_shape, placements):
            raise ValueError(
                f"shape {tuple(global_shape)} with placements {tuple(placements)} on mesh {tuple(mesh_shape)} "
                f"is sharded unevenly: the local shape depends on the rank, give its mesh coordinate"
            )
        coordinate = [0] * len(mesh_shape)
    return local_shape_and_offset(global_shape, mesh_shape, placements, coordinate)[0]


def max_local_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """The largest shard (mesh coordinate 0 holds it): what padded collectives move per rank."""
    return local_shape(global_shape, mesh_shape, placements, [0] * len(mesh_shape))


def global_shape(
    local: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """The global shape whose even sharding gives ``local`` on every rank (what ``from_local``
    assumes without ``shape=``, as torch does)."""
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
    return local_shape_and_offset(global_shape, mesh_shape, placements, coordinate)[1]


def size_before(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
    mesh_dim: int,
    tensor_dim: int,
) -> int:
    """Size of ``tensor_dim`` after the splits of the mesh dims before ``mesh_dim``: the size that
    mesh dim ``mesh_dim`` splits (or gathers back) at ``coordinate``."""
    size = global_shape[tensor_dim]
    for k, p in enumerate(placements[:mesh_dim]):
        if isinstance(p, Shard) and p.dim == tensor_dim:
            size = chunk_size_and_offset(size, mesh_shape[k], coordinate[k])[0]
    return size


def even_placements(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: tuple[Placement, ...]
) -> tuple[Placement, ...]:
    """``placements`` with every ``Shard`` of an unevenly split tensor dim made ``Replicate``: the
    nearest layout in which every rank holds the same shard shape (unchanged when already even).
    Op rules that assume equal shards see their uneven inputs this way and the inputs are
    redistributed to it first, which is correct whatever the rule."""
    size = list(global_shape)
    uneven: set[int] = set()
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard) and 0 <= p.dim < len(size):
            if size[p.dim] % mesh_shape[mesh_dim]:
                uneven.add(p.dim)
            size[p.dim] //= mesh_shape[mesh_dim]
    if not uneven:
        return placements
    return tuple(Replicate() if isinstance(p, Shard) and p.dim in uneven else p for p in placements)
