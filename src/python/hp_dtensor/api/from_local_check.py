"""``from_local(run_check=True)`` for every backend: one fixed-size record per rank, one verdict.

Every rank encodes what it was given -- local shape, dtype, placements, the ``shape=`` it passed,
whether its own argument checks passed (and a crc of their error), and a digest of its data -- as
``RECORD_LEN`` integers whatever its tensor looks like: a shape or placement list longer than the
record keeps shows its first entries, and a crc of the whole value is compared.  The records are
all-gathered (the same size on every rank, so the collective can neither mismatch nor abort) and
every rank runs the same ``verify`` on the same table: every rank raises the same ``ValueError``
naming each rank's value, or none does.

The data digest is of the exact bytes (blake2b-128 of the values in row-major order), not of float
sums.  ``Replicate`` means bit-identical copies -- what broadcasting one rank's tensor would give
-- and a float sum misses real differences: one NaN hides every other element and
``1e20 + 1 == 1e20``.  Identical NaNs therefore pass, while ``-0.0`` against ``0.0`` (or NaNs of
different bit patterns) is reported: ops that see the sign of zero (``1 / x``, ``atan2``,
``copysign``) would make the replicas drift apart.  The digest is only computed when the
placements hold a ``Replicate`` (every rank agrees on that before the data are compared).

A backend supplies primitives only: the local shape, its dtype's name, the bytes of the values and
its collectives (``spec_for_from_local``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hp_dtensor.api.dtensor_methods import from_local_checked
from hp_dtensor.api.mesh_exchange import gather_over_mesh
from hp_dtensor.layout.mesh_layout import MeshLayout
from hp_dtensor.layout.shard_geometry import local_shape
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard, normalize_placements

if TYPE_CHECKING:
    from hp_dtensor.backend_contract import Collectives
    from hp_dtensor.device_mesh import DeviceMesh
    from hp_dtensor.layout.dtensor_spec import DTensorSpec

# The bytes of a tensor's values, row-major and contiguous (a numpy array's or a memoryview's
# buffer serves): what a backend hands to ``spec_for_from_local``.
DataBytes = bytes | bytearray | memoryview

MAX_NDIM = 16  # dims shown in messages; a crc of the whole shape is compared
MAX_MESH_NDIM = 8
NAME_CHARS = 16
_OPS = ("sum", "avg", "max", "min")
_NOT_A_PLACEMENT, _REPLICATE, _PARTIAL, _SHARD = 0, 1, 2, 1_000_000  # Partial: 2 + op index
_PAD = -1
_NONE, _UNREADABLE = -1, -2  # the shape= field's length when not given / not a sequence of ints
_INT_LIMIT = 2**62  # shown values are clamped here so the int64 exchange never overflows


def _field(values: Sequence[int], n: int) -> list[int]:
    """[len, crc of the whole value, first n entries (padded)]: fixed width for any length."""
    v = list(values)
    shown = [max(-_INT_LIMIT, min(_INT_LIMIT, x)) for x in v[:n]]
    return [len(v), zlib.crc32(repr(v).encode())] + shown + [_PAD] * (n - len(shown))


def _unfield(row: Sequence[int], pos: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the field as compared, the entries shown) of the field at ``row[pos]``."""
    whole = tuple(row[pos : pos + 2 + n])
    return whole, tuple(row[pos + 2 : pos + 2 + max(0, min(row[pos], n))])


# ok, error crc | shape field | dtype crc, name chars | placements field | shape= field | digest (2)
RECORD_LEN = 2 + (2 + MAX_NDIM) + (1 + NAME_CHARS) + (2 + MAX_MESH_NDIM) + (2 + MAX_NDIM) + 2


def canonical_dtype(name: str) -> str:
    """One spelling per dtype for both frameworks: ``torch.float32`` and MindSpore's ``Float32``
    are both ``float32`` (``BFloat16`` -> ``bfloat16``, ``Bool`` -> ``bool``)."""
    return name.rsplit(".", 1)[-1].lower()


def _placement_code(p: object) -> int:
    if isinstance(p, Shard):
        return _SHARD + p.dim
    if isinstance(p, Partial):
        return _PARTIAL + _OPS.index(p.reduce_op)
    if isinstance(p, Replicate):
        return _REPLICATE
    return _NOT_A_PLACEMENT  # the rank's own argument check reports it


def _placement_of(code: int) -> Placement | None:
    if code == _REPLICATE:
        return Replicate()
    if _PARTIAL <= code < _PARTIAL + len(_OPS):
        return Partial(_OPS[code - _PARTIAL])  # type: ignore[arg-type]
    if code >= _SHARD // 2:
        return Shard(code - _SHARD)
    return None


def _placement_codes(placements: object, mesh_ndim: int, ndim: int) -> tuple[int, ...]:
    """The placements as ``from_local`` reads them (negative shard dims resolved) when they are
    valid, else as given: a rank's argument check reports what is wrong with them."""
    if placements is None:
        return (_REPLICATE,) * mesh_ndim
    try:
        return tuple(_placement_code(p) for p in normalize_placements(placements, mesh_ndim, ndim))
    except (TypeError, ValueError):
        pl = placements if isinstance(placements, (list, tuple)) else (placements,)
        return tuple(_placement_code(p) for p in pl)


def _ints_or_none(shape: object) -> list[int] | None:
    try:
        return [int(s) for s in shape]  # type: ignore[attr-defined]
    except (TypeError, ValueError, OverflowError):
        return None


def data_digest(data: DataBytes) -> tuple[int, int]:
    """blake2b-128 of the bytes, as two int64s."""
    d = hashlib.blake2b(data, digest_size=16).digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


def encode(
    error: BaseException | None,
    shape: Sequence[int],
    dtype: str,
    placements: object,
    mesh_ndim: int,
    global_shape: object,
    digest: tuple[int, int],
) -> list[int]:
    """This rank's record: ``RECORD_LEN`` ints whatever the arguments are (never raises for a
    malformed ``placements`` or ``global_shape``: those are the rank's own argument error)."""
    dims = [int(s) for s in shape]
    name = canonical_dtype(dtype).encode()[:NAME_CHARS]
    if global_shape is None:
        gs = [_NONE, 0] + [_PAD] * MAX_NDIM
    else:
        ints = _ints_or_none(global_shape)
        gs = [_UNREADABLE, 0] + [_PAD] * MAX_NDIM if ints is None else _field(ints, MAX_NDIM)
    return (
        [int(error is None), 0 if error is None else zlib.crc32(f"{type(error).__name__}: {error}".encode())]
        + _field(dims, MAX_NDIM)
        + [zlib.crc32(canonical_dtype(dtype).encode())] + list(name) + [0] * (NAME_CHARS - len(name))
        + _field(_placement_codes(placements, mesh_ndim, len(dims)), MAX_MESH_NDIM)
        + gs
        + list(digest)
    )


@dataclass(frozen=True)
class LocalRecord:
    """One rank's decoded record: ``*_key`` is what ranks must agree on, the rest is shown."""

    ok: bool
    error_crc: int
    ndim: int
    shape_key: tuple[int, ...]
    shape: tuple[int, ...]
    dtype_key: tuple[int, ...]
    dtype: str
    placements_key: tuple[int, ...]
    placements: tuple[int, ...]
    global_shape_key: tuple[int, ...]
    global_shape: tuple[int, ...] | None
    digest: tuple[int, int]

    @staticmethod
    def decode(row: Sequence[int]) -> LocalRecord:
        row = [int(x) for x in row]
        pos = 2
        shape_key, shape = _unfield(row, pos, MAX_NDIM)
        pos += 2 + MAX_NDIM
        dtype_key = tuple(row[pos : pos + 1 + NAME_CHARS])
        dtype = bytes(c for c in row[pos + 1 : pos + 1 + NAME_CHARS] if 0 < c < 256).decode(errors="replace")
        pos += 1 + NAME_CHARS
        pl_key, pl = _unfield(row, pos, MAX_MESH_NDIM)
        pos += 2 + MAX_MESH_NDIM
        gs_key, gs = _unfield(row, pos, MAX_NDIM)
        pos += 2 + MAX_NDIM
        return LocalRecord(
            bool(row[0]), row[1], row[2], shape_key, shape, dtype_key, dtype, pl_key, pl,
            gs_key, None if gs_key[0] < 0 else gs,
            (row[pos], row[pos + 1]),
        )

    def shown_shape(self) -> str:
        return _shown(self.shape, self.ndim)

    def shown_placements(self) -> str:
        shown = ", ".join(repr(p) if (p := _placement_of(c)) else "?" for c in self.placements)
        return "[" + shown + (", ..." if self.placements_key[0] > MAX_MESH_NDIM else "") + "]"

    def shown_global_shape(self) -> str:
        n = self.global_shape_key[0]
        if n == _NONE:
            return "None"
        return "?" if n == _UNREADABLE else _shown(self.global_shape or (), n)


def _shown(dims: tuple[int, ...], ndim: int) -> str:
    if ndim > len(dims):
        return "(" + ", ".join(map(str, dims)) + ", ...)"
    return str(dims)


def _differ(layout: MeshLayout, what: str, values: Sequence[object]) -> str:
    detail = ", ".join(f"rank {r}: {v}" for r, v in zip(layout.ranks, values))
    return f"from_local(run_check=True): the {what} differs across the mesh ({detail})"


def _layout_of(rec: LocalRecord, mesh_ndim: int) -> tuple[tuple[int, ...], tuple[Placement, ...]] | None:
    """(shape=, placements) when both are ones ``from_local`` accepts for this ndim, else None."""
    gs = rec.global_shape
    if gs is None or rec.global_shape_key[0] != rec.ndim or rec.ndim > MAX_NDIM or any(s < 0 for s in gs):
        return None
    pl = tuple(_placement_of(c) for c in rec.placements)
    if len(pl) != mesh_ndim or rec.placements_key[0] != mesh_ndim:
        return None
    out: list[Placement] = []
    for p in pl:
        if p is None or (isinstance(p, Shard) and not 0 <= p.dim < rec.ndim):
            return None
        out.append(p)
    return gs, tuple(out)


def verify(rows: Sequence[Sequence[int]], layout: MeshLayout) -> None:
    """Raise the same ``ValueError`` on every rank when the gathered records (``rows[i]`` from the
    mesh's i-th rank, row-major) do not describe one DTensor; return when they do, or when every
    rank's own argument check failed with the same error (each rank then raises that error)."""
    recs = [LocalRecord.decode(r) for r in rows]
    for what, key, shown in (
        ("ndim", lambda r: r.ndim, lambda r: r.ndim),
        ("dtype", lambda r: r.dtype_key, lambda r: r.dtype),
        ("placements", lambda r: r.placements_key, LocalRecord.shown_placements),
        ("shape= argument", lambda r: r.global_shape_key, LocalRecord.shown_global_shape),
    ):
        keys = [key(r) for r in recs]
        if any(k != keys[0] for k in keys):
            raise ValueError(_differ(layout, what, [shown(r) for r in recs]) + "; pass the same on every rank")
    first = recs[0]
    if first.global_shape_key[0] == _NONE:
        if any(r.shape_key != first.shape_key for r in recs):
            raise ValueError(
                _differ(layout, "local shape", [r.shown_shape() for r in recs])
                + "; uneven shards need the global shape=(...) (and stride=) on every rank"
            )
    elif (gl := _layout_of(first, layout.ndim)) is not None:
        gs, pl = gl
        want = [local_shape(gs, layout.shape, pl, layout.coordinate_of(rank)) for rank in layout.ranks]
        if any(r.shape_key[0] != len(w) or r.shape != w for r, w in zip(recs, want)):
            detail = ", ".join(
                f"rank {rank}: {r.shown_shape()} (want {w})" for rank, r, w in zip(layout.ranks, recs, want)
            )
            raise ValueError(
                f"from_local(run_check=True): local shards do not tile shape={gs} with placements {pl} "
                f"({detail}); pass each rank its torch.chunk-style piece"
            )
    failed = [rank for rank, r in zip(layout.ranks, recs) if not r.ok]
    if len(failed) == len(recs) and all(r.error_crc == first.error_crc for r in recs):
        return  # every rank failed alike: each raises its own (identical) argument error
    if failed:
        raise ValueError(
            f"from_local(run_check=True): the arguments failed their checks on ranks {failed} "
            f"(the error on those ranks is chained to this one as its cause)"
        )
    # Replicate mesh dims: every group along such a dim must hold bit-identical data.
    for k, code in enumerate(first.placements):
        if code != _REPLICATE:
            continue
        for group in layout.groups_along(k):
            digests = [recs[layout.ranks.index(rank)].digest for rank in group]
            if any(d != digests[0] for d in digests):
                diff = [rank for rank, d in zip(group, digests) if d != digests[0]]
                listed = ", ".join(f"rank {rank}: {d[0] & 0xFFFFFFFF:08x}" for rank, d in zip(group, digests))
                raise ValueError(
                    f"from_local(run_check=True): placement Replicate() on mesh dim {k} but ranks "
                    f"{list(group)} hold different data (ranks {diff} differ from rank {group[0]} bit for "
                    f"bit; data digests {listed}); pass bit-identical copies (-0.0 is not 0.0), e.g. "
                    f"broadcast the tensor first, or use Shard/Partial"
                )


def spec_for_from_local(
    local_shape_: Sequence[int],
    dtype: str,
    data: Callable[[], DataBytes],
    mesh: DeviceMesh,
    placements: Sequence[Placement] | Placement | None,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    run_check: bool,
    collectives: Collectives,
) -> DTensorSpec:
    """``from_local``'s spec: without ``run_check`` from this rank's arguments alone
    (``from_local_checked``); with it, the same spec once every rank of the mesh has exchanged its
    record and agreed.  ``data()`` returns the bytes of this rank's
    values (row-major); it is called only when the placements hold a ``Replicate``.  Every rank
    raises the same ``ValueError`` when the ranks disagree; a rank whose own arguments were wrong
    raises it with its own error chained as the cause.  Ranks outside the mesh take no part in the
    mesh's collectives and only check their own arguments."""
    if not run_check:
        return from_local_checked(local_shape_, dtype, mesh, placements, shape, stride)
    error: Exception | None = None
    spec: DTensorSpec | None = None
    try:
        spec = from_local_checked(local_shape_, dtype, mesh, placements, shape, stride)
    except (TypeError, ValueError) as e:
        error = e
    if mesh.get_coordinate() is not None:
        codes = _placement_codes(placements, mesh.ndim, len(local_shape_))
        digest = (0, 0)
        if _REPLICATE in codes:
            try:
                digest = data_digest(data())
            except Exception as e:  # noqa: BLE001 -- reported on every rank by the verdict, then raised here
                error = error or e
        row = encode(error, local_shape_, dtype, placements, mesh.ndim, shape, digest)
        try:
            verify(gather_over_mesh([row], mesh, collectives), mesh.layout)
        except ValueError as verdict:
            raise verdict from error
    if error is not None:
        raise error
    assert spec is not None
    return spec

