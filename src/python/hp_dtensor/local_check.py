"""What ``from_local(run_check=True)`` compares across ranks, framework-neutral.

Each rank encodes its local tensor's metadata as one fixed-length row of integers (so the
exchange itself can never mismatch, whatever the ranks hold): ndim, shape, dtype name,
placements and a checksum of the data.  Once every rank holds every row, each rank runs the same
checks on the same table and raises the same ``ValueError`` naming each rank's value.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.placement_types import Partial, Placement, Shard
from hp_dtensor.shard_geometry import check_equal_shard_shapes, local_shape

_MAX_DIMS = 16  # dims shown in messages; a checksum of the whole shape covers more
_NAME_CHARS = 16
_REDUCE_CODES = {"sum": -2, "avg": -3, "max": -4, "min": -5}


def _placement_code(p: Placement) -> int:
    if isinstance(p, Shard):
        return p.dim
    if isinstance(p, Partial):
        return _REDUCE_CODES[p.reduce_op]
    return -1


def _placement_of(code: int) -> str:
    if code >= 0:
        return f"S({code})"
    return "R" if code == -1 else "P(" + {v: k for k, v in _REDUCE_CODES.items()}[code] + ")"


def record_length(mesh_ndim: int) -> int:
    return 4 + _MAX_DIMS + _NAME_CHARS + mesh_ndim


def local_record(shape: Sequence[int], dtype_name: str, placements: Sequence[Placement], data: bytes) -> list[int]:
    """This rank's row: [ndim, crc(shape), crc(data), crc(dtype), dims..., dtype name..., placements...]."""
    dims = [int(s) for s in shape]
    name = dtype_name.encode()[:_NAME_CHARS]
    return (
        [len(dims), zlib.crc32(repr(dims).encode()), zlib.crc32(data), zlib.crc32(dtype_name.encode())]
        + (dims + [-1] * _MAX_DIMS)[:_MAX_DIMS]
        + list(name) + [0] * (_NAME_CHARS - len(name))
        + [_placement_code(p) for p in placements]
    )


def _shape_of(row: Sequence[int]) -> list[int]:
    """The shape shown in messages (its first dims; the compared checksum covers all of them)."""
    return list(row[4 : 4 + min(row[0], _MAX_DIMS)])


def _dtype_of(row: Sequence[int]) -> str:
    chars = row[4 + _MAX_DIMS : 4 + _MAX_DIMS + _NAME_CHARS]
    return bytes(c for c in chars if c).decode(errors="replace")


def check_local_records(rows: Sequence[Sequence[int]], mesh: DeviceMesh,
                        global_shape: Sequence[int] | None = None,
                        placements: Sequence[Placement] | None = None) -> None:
    """``rows[i]`` is the record of the mesh's i-th rank (row-major).  Raise ``ValueError`` naming
    every rank's value when ranks disagree on ndim, dtype, placements or shape, or when ranks that
    share a ``Replicate`` mesh dim hold different data.  With ``global_shape`` (``from_local``'s
    ``shape=``, which may shard unevenly) each rank's shard must have the shape its coordinate
    gets under ``placements``, instead of all shards being equal."""
    ranks = mesh.layout.ranks

    def check(field: str, keys: Sequence[object], shown: Sequence[object]) -> None:
        if any(k != keys[0] for k in keys):
            detail = ", ".join(f"rank {rank}: {v}" for rank, v in zip(ranks, shown))
            raise ValueError(
                f"from_local(run_check=True): the local tensors differ in {field} across the mesh ({detail})"
            )

    check("ndim", [r[0] for r in rows], [r[0] for r in rows])
    check("dtype", [r[3] for r in rows], [_dtype_of(r) for r in rows])
    pl_start = 4 + _MAX_DIMS + _NAME_CHARS
    pls = [tuple(r[pl_start:]) for r in rows]
    check("placements", pls, ["[" + ", ".join(_placement_of(c) for c in p) + "]" for p in pls])
    if global_shape is None or placements is None:
        check_equal_shard_shapes([_shape_of(r) + [r[1]] for r in rows], mesh)
    else:
        want = [list(local_shape(global_shape, mesh.shape, placements, _coordinate(i, mesh.shape)))
                for i in range(len(rows))]
        if any(_shape_of(r) != w for r, w in zip(rows, want)):
            detail = ", ".join(f"rank {rank}: {tuple(_shape_of(r))} (want {tuple(w)})"
                               for rank, r, w in zip(ranks, rows, want))
            raise ValueError(
                f"from_local(run_check=True): local shards do not tile shape={tuple(global_shape)} with "
                f"placements {tuple(placements)} ({detail})"
            )
    codes = pls[0]
    shape = mesh.shape
    for k, code in enumerate(codes):
        if code != -1:
            continue
        # ranks differing only in coordinate k must hold the same bytes
        stride = 1
        for s in shape[k + 1 :]:
            stride *= s
        for i, r in enumerate(rows):
            coord_k = (i // stride) % shape[k]
            if coord_k == 0:
                continue
            first = rows[i - coord_k * stride]
            if first[2] != r[2]:
                raise ValueError(
                    f"from_local(run_check=True): placements say Replicate() on mesh dim {k}, but rank "
                    f"{ranks[i - coord_k * stride]} and rank {ranks[i]} hold different data (checksums "
                    f"{first[2]:#010x} and {r[2]:#010x}); pass the same tensor on every rank of that dim or "
                    f"use distribute_tensor to broadcast it"
                )


def _coordinate(i: int, mesh_shape: Sequence[int]) -> list[int]:
    """Mesh coordinate of the i-th rank in row-major order."""
    coord = []
    for s in reversed(mesh_shape):
        coord.append(i % s)
        i //= s
    return coord[::-1]


__all__ = ["check_local_records", "local_record", "record_length"]
