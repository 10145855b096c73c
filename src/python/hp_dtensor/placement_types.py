"""Placements: how one mesh dimension lays a tensor out.

``Shard(d)`` splits tensor dim ``d`` over the mesh dim (``torch.chunk``-style when uneven), ``Replicate()`` keeps a full
copy on every rank, ``Partial(op)`` holds per-rank values whose reduction by ``op`` is the
tensor.  Placements are immutable values: equal by value, hashable, usable as dict keys.
This module is pure: it imports no framework.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ReduceOp = Literal["sum", "avg", "max", "min"]
_REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


class Placement:
    """Base class of the three placements."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split tensor dim ``dim`` into contiguous chunks, chunk ``i`` on mesh coordinate ``i``: like
    ``torch.chunk``, every chunk has ``ceil(size / n)`` elements but the last non-empty one, and
    trailing coordinates may hold none.

    A negative ``dim`` counts from the end and is resolved against the tensor it is applied to
    (``normalize``).
    """

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def normalize(self, ndim: int) -> Shard:
        """Resolve a negative dim against a tensor of ``ndim`` dims."""
        d = self.dim + ndim if self.dim < 0 else self.dim
        if not 0 <= d < max(ndim, 1) or ndim == 0:
            raise ValueError(
                f"Shard({self.dim}) is out of range for a tensor with {ndim} dims; "
                f"use a dim in [-{ndim}, {ndim})"
            )
        return self if d == self.dim else Shard(d)

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a same-shaped partial value; the tensor is their reduction by ``reduce_op``."""

    reduce_op: ReduceOp = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op={self.reduce_op!r}) is not one of {_REDUCE_OPS}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


def check_partials(placements: tuple[Placement, ...]) -> None:
    """Raise ``ValueError`` for Partials of different reduce ops on one tensor (other than sum with
    avg): their reductions do not commute, so the value would depend on the order."""
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1 and ops != {"sum", "avg"}:
        raise ValueError(
            f"placements {placements} mix Partial reduce ops {sorted(ops)}: a tensor may hold one kind "
            f"of partial value (sum and avg may be mixed); reduce one of them first (redistribute to "
            f"Replicate or Shard)"
        )


def normalize_placements(
    placements: object, mesh_ndim: int, tensor_ndim: int | None = None
) -> tuple[Placement, ...]:
    """Check a placements argument against a mesh and return it as a tuple.

    A single placement is accepted for a 1-D mesh.  Negative shard dims are resolved when
    ``tensor_ndim`` is known.
    """
    if isinstance(placements, Placement):
        placements = (placements,)
    if not isinstance(placements, (list, tuple)):
        raise TypeError(
            f"placements must be a Placement or a sequence of Placements, got {type(placements).__name__}"
        )
    out: list[Placement] = []
    for p in placements:
        if not isinstance(p, Placement) or type(p) is Placement:
            raise TypeError(f"placements must hold Shard/Replicate/Partial, got {p!r}")
        if tensor_ndim is not None and isinstance(p, Shard):
            p = p.normalize(tensor_ndim)
        out.append(p)
    if len(out) != mesh_ndim:
        raise ValueError(
            f"got {len(out)} placements {tuple(out)} for a {mesh_ndim}-D mesh; "
            f"give exactly one placement per mesh dim"
        )
    check_partials(tuple(out))
    return tuple(out)


def partials_replicated(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with every ``Partial`` read as ``Replicate``: the layout of a fresh value
    (a random draw, a factory) made in the shape of a partial tensor, which is no sum of terms."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
