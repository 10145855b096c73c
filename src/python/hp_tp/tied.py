"""Tied parameters under tensor parallelism.

A parameter held by two modules (tied input and output embeddings) must stay one parameter after
both are split: one storage, and one ``.grad`` into which autograd sums both uses.  Splitting each
holder on its own would leave two copies that load and train apart, silently.  The first style to
split the parameter records the DTensor parameter it made; a later style meeting the same original
parameter reuses that one, and refuses (naming both holders) if it would place it differently.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from hp_dtensor import DeviceMesh, Placement


@dataclass(frozen=True)
class _Split:
    param: Any  # the DTensor parameter that replaced the original
    mesh: DeviceMesh
    placement: Placement
    holder: str  # "<module type>.<name>" of the first holder, for error messages


# Keyed by id with a weak reference to check identity: tensors compare elementwise, so they cannot
# be keys of a WeakKeyDictionary, and a strong reference would keep the unsplit weight alive.
_splits: dict[int, tuple[weakref.ref[Any], _Split]] = {}


def _lookup(original: Any) -> _Split | None:
    entry = _splits.get(id(original))
    if entry is None or entry[0]() is not original:
        return None
    return entry[1]


def already_split(original: Any, mesh: DeviceMesh, placement: Placement, holder: str) -> Any | None:
    """The DTensor parameter ``original`` was already turned into, or ``None`` the first time.

    Raises ``ValueError`` when the tie would need two different layouts."""
    done = _lookup(original)
    if done is None:
        return None
    if done.mesh != mesh or done.placement != placement:
        raise ValueError(
            f"tied parameter shared by {done.holder} and {holder} would be split two ways: "
            f"{done.placement!r} on {done.mesh} by the first style, {placement!r} on {mesh} by this one; "
            f"a tied parameter keeps one layout, so give both holders styles that split it the same way "
            f"(e.g. RowwiseParallel on the Embedding with ColwiseParallel on the output Linear: both Shard(0))"
        )
    return done.param


def record_split(original: Any, new: Any, mesh: DeviceMesh, placement: Placement, holder: str) -> None:
    try:
        ref = weakref.ref(original)
    except TypeError:  # a framework parameter that cannot be weakly referenced: no tie tracking
        return
    for key in [k for k, (r, _) in _splits.items() if r() is None]:
        del _splits[key]
    _splits[id(original)] = (ref, _Split(new, mesh, placement, holder))


def unsplit_ties(named_params: list[tuple[str, Any]]) -> list[str]:
    """Names in ``named_params`` (every holder, duplicates kept) still holding an original whose
    tie partner was split: the tie is broken there."""
    return [name for name, p in named_params if _lookup(p) is not None]
