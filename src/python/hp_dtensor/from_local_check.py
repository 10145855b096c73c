"""``from_local(run_check=True)``: one fixed-size metadata record per rank, then one verdict.

Every rank encodes what it was given -- ndim, local shape, dtype, placements, the ``shape=`` it
passed, whether its own argument checks failed, and a checksum of its data -- as ``RECORD_LEN``
integers, whatever its tensor looks like.  The records are all-gathered (same size on every rank,
so the collective can neither mismatch nor abort), and every rank runs the same ``verify`` on the
same table: all raise the same ``ValueError`` naming each rank's value, or none does.  Pure: the
platform supplies the encoding of its dtypes and the checksum.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from hp_dtensor.mesh_layout import MeshLayout
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.shard_geometry import local_shape

MAX_NDIM = 16
MAX_MESH_NDIM = 8
_OPS = ("sum", "avg", "max", "min")
# ok, ndim, shape..., dtype, mesh ndim, placements..., shape= given, shape=..., checksum (2)
RECORD_LEN = 2 + MAX_NDIM + 1 + 1 + MAX_MESH_NDIM + 1 + MAX_NDIM + 2
_DTYPES = (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)


def dtype_code(name: str) -> int:
    """A code for a dtype name that every process computes alike (``hash`` is salted per process)."""
    short = name.rsplit(".", 1)[-1]
    return _DTYPES.index(short) if short in _DTYPES else 1000 + zlib.crc32(short.encode())


def dtype_name(code: int) -> str:
    return _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype#{code}"


def _placement_code(p: Placement | object) -> int:
    if isinstance(p, Shard):
        return 1000 + p.dim
    if isinstance(p, Partial):
        return 3000 + _OPS.index(p.reduce_op)
    if isinstance(p, Replicate):
        return 1
    return 0  # not a placement: the local argument check reports it


def _placement_str(code: int) -> str:
    if code == 1:
        return "Replicate()"
    if 1000 <= code < 3000:
        return f"Shard(dim={code - 1000})"
    if 3000 <= code < 3000 + len(_OPS):
        return f"Partial({_OPS[code - 3000]})"
    return "?"


@dataclass(frozen=True)
class LocalRecord:
    """What one rank passed to ``from_local``."""

    ok: bool  # its own argument checks passed
    shape: tuple[int, ...]
    dtype: int
    placements: tuple[int, ...]
    global_shape: tuple[int, ...] | None
    checksum: tuple[int, int]

    def encode(self) -> list[int]:
        def fixed(values: Sequence[int], n: int) -> list[int]:
            v = list(values)[:n]
            return v + [-1] * (n - len(v))

        gs = self.global_shape
        return (
            [int(self.ok), len(self.shape)] + fixed(self.shape, MAX_NDIM) + [self.dtype, len(self.placements)]
            + fixed(self.placements, MAX_MESH_NDIM) + [-1 if gs is None else len(gs)]
            + fixed(gs or (), MAX_NDIM) + list(self.checksum)
        )

    @staticmethod
    def decode(row: Sequence[int]) -> LocalRecord:
        row = [int(x) for x in row]
        ndim = row[1]
        pos = 2 + MAX_NDIM
        dtype, mesh_ndim = row[pos], row[pos + 1]
        pos += 2
        placements = tuple(row[pos : pos + min(mesh_ndim, MAX_MESH_NDIM)])
        pos += MAX_MESH_NDIM
        gs_len = row[pos]
        gs = None if gs_len < 0 else tuple(row[pos + 1 : pos + 1 + min(gs_len, MAX_NDIM)])
        pos += 1 + MAX_NDIM
        return LocalRecord(
            bool(row[0]), tuple(row[2 : 2 + min(ndim, MAX_NDIM)]), dtype, placements, gs, (row[pos], row[pos + 1])
        )


def make_record(
    ok: bool,
    shape: Sequence[int],
    dtype: str,
    placements: object,
    global_shape: Sequence[int] | None,
    checksum: tuple[int, int],
) -> LocalRecord:
    pl = placements if isinstance(placements, (list, tuple)) else (placements,)
    return LocalRecord(
        ok and len(shape) <= MAX_NDIM and len(pl) <= MAX_MESH_NDIM,
        tuple(int(s) for s in shape),
        dtype_code(dtype),
        tuple(_placement_code(p) for p in pl),
        None if global_shape is None else tuple(int(s) for s in global_shape),
        checksum,
    )


def _differ(layout: MeshLayout, what: str, values: Sequence[object]) -> str:
    detail = ", ".join(f"rank {r}: {v}" for r, v in zip(layout.ranks, values))
    return f"from_local(run_check=True): the {what} differs across the mesh ({detail})"


def verify(rows: Sequence[Sequence[int]], layout: MeshLayout) -> None:
    """Raise the same ``ValueError`` on every rank when the gathered records (``rows[i]`` from the
    mesh's i-th rank, row-major) do not describe one DTensor."""
    recs = [LocalRecord.decode(r) for r in rows]
    for what, get in (
        ("ndim", lambda r: len(r.shape)),
        ("dtype", lambda r: dtype_name(r.dtype)),
        ("placements", lambda r: "[" + ", ".join(_placement_str(c) for c in r.placements) + "]"),
        ("shape= argument", lambda r: r.global_shape),
    ):
        values = [get(r) for r in recs]
        if any(v != values[0] for v in values):
            raise ValueError(_differ(layout, what, values) + "; pass the same on every rank")
    bad = [rank for rank, r in zip(layout.ranks, recs) if not r.ok]
    if len(bad) == len(recs):
        return  # every rank failed alike: each raises its own (identical) argument error
    if bad:
        raise ValueError(
            f"from_local(run_check=True): the arguments failed their checks on ranks {bad} "
            f"(the exception on those ranks says why)"
        )
    first = recs[0]
    pl: list[Placement] = []
    for c in first.placements:
        pl.append(Replicate() if c == 1 else Shard(c - 1000) if c < 3000 else Partial(_OPS[c - 3000]))  # type: ignore[arg-type]
    if first.global_shape is None:
        if any(r.shape != first.shape for r in recs):
            raise ValueError(
                _differ(layout, "local shape", [r.shape for r in recs])
                + "; uneven shards need the global shape=(...) (and stride=) on every rank"
            )
    else:
        want = [local_shape(first.global_shape, layout.shape, pl, layout.coordinate_of(rank)) for rank in layout.ranks]
        if any(r.shape != w for r, w in zip(recs, want)):
            detail = ", ".join(
                f"rank {rank}: {r.shape} (expected {w})" for rank, r, w in zip(layout.ranks, recs, want)
            )
            raise ValueError(
                f"from_local(run_check=True): local shapes do not tile shape={first.global_shape} with "
                f"placements {tuple(pl)} ({detail})"
            )
    # Replicate mesh dims: every group along such a dim must hold identical data.
    for k, p in enumerate(pl):
        if not isinstance(p, Replicate):
            continue
        for group in layout.groups_along(k):
            sums = [recs[layout.ranks.index(rank)].checksum for rank in group]
            if any(s != sums[0] for s in sums):
                diff = [rank for rank, s in zip(group, sums) if s != sums[0]]
                raise ValueError(
                    f"from_local(run_check=True): placement Replicate() on mesh dim {k} but ranks "
                    f"{list(group)} hold different data (ranks {diff} differ from rank {group[0]}); "
                    f"broadcast the tensor first or use Shard/Partial"
                )
