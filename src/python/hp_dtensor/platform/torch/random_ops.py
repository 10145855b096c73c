"""Random aten ops on DTensors: draw the global tensor, keep this rank's shard.

The policy (why every rank draws the global tensor, when generator states are synchronised) is
in ``hp_dtensor.api.rng_tracker``, and which aten ops draw random numbers (and how each uses its
first argument) is ``hp_dtensor.sharding.random_ops``; this module is torch's half: how each kind's
global draw is made from a stand-in of the global shape, and the generator primitives the tracker
needs.

Placements of the result: an in-place op keeps its tensor's placements (on a ``Partial("sum")``
mesh dim the drawn values are kept on coordinate 0 and zeros elsewhere, so the sum is the draw);
a ``*_like`` op returns its input's placements with ``Partial`` replaced by ``Replicate``;
dropout keeps its input's placements (it is linear in the input for a fixed mask, and the mask
is the same on every rank) and returns the mask with ``Partial`` replaced by ``Replicate``.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.api.rng_tracker import ensure_synced
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.placement_types import Placement, Replicate, partials_replicated
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec
from hp_dtensor.platform.torch.redistribute import redistribute_local
from hp_dtensor.redistribute.executor import run_plan
from hp_dtensor.redistribute.planner import plan_distribute
from hp_dtensor.sharding.random_ops import ATEN_RANDOM_OPS, RandomKind


def _replicated(n: int) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(n))


def _shard_of(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of a tensor every rank holds whole (local slicing, no collective)."""
    return redistribute_local(full, mesh, tuple(full.shape), _replicated(mesh.ndim), placements)


def _stand_in(dt: DTensor) -> torch.Tensor:
    local = dt._local_tensor
    return torch.empty(dt._spec.shape, dtype=local.dtype, device=local.device)


def _whole(value: Any, mesh: DeviceMesh) -> Any:
    """A DTensor argument as the whole tensor (the draw needs every value); others unchanged."""
    if not isinstance(value, DTensor):
        return value
    spec = value._spec
    return redistribute_local(value._local_tensor, mesh, spec.shape, spec.placements, _replicated(mesh.ndim))


def run_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run random aten op ``func`` whose first argument is a DTensor."""
    dt = args[0]
    if not isinstance(dt, DTensor):
        raise TypeError(f"{func}: the first argument must be a DTensor, got {type(dt).__name__}")
    spec = dt._spec
    mesh = spec.mesh
    rest = tuple(_whole(a, mesh) for a in args[1:])
    kw = {k: _whole(v, mesh) for k, v in kwargs.items()}
    ensure_synced(mesh)
    kind = ATEN_RANDOM_OPS[str(func)]
    if kind is RandomKind.FILL:
        full = _stand_in(dt)
        func(full, *rest, **kw)
        dt._local_tensor.copy_(_shard_of(full, mesh, spec.placements))
        return dt
    if kind is RandomKind.LIKE:
        out_pl = partials_replicated(spec.placements)
        full = func(_stand_in(dt), *rest, **kw)
        return DTensor(_shard_of(full, mesh, out_pl), DTensorSpec(mesh, out_pl, spec.shape))
    if kind is RandomKind.BY_VALUE:
        probs = _whole(dt, mesh)
        if str(func) == "aten.bernoulli_.Tensor":
            full = torch.empty_like(probs).bernoulli_(*rest, **kw)
            dt._local_tensor.copy_(_shard_of(full, mesh, spec.placements))
            return dt
        out_pl = partials_replicated(spec.placements)
        full = func(probs, *rest, **kw)
        return DTensor(_shard_of(full, mesh, out_pl), DTensorSpec(mesh, out_pl, spec.shape))
    if kind is not RandomKind.DROPOUT:
        raise AssertionError(f"{func}: no draw for random-op kind {kind}")  # pragma: no cover - a new kind
    p, train = rest[0], rest[1] if len(rest) > 1 else kw.get("train")
    if not train:
        # No draw: the op is the identity with an all-true mask.
        out, mask = func(dt._local_tensor, *rest, **kw)
        mask_pl = partials_replicated(spec.placements)
        return (
            DTensor(out, DTensorSpec(mesh, spec.placements, spec.shape)),
            DTensor(mask, DTensorSpec(mesh, mask_pl, spec.shape)),
        )
    _, full_mask = func(_stand_in(dt), *rest, **kw)
    mask_pl = partials_replicated(spec.placements)
    mask = _shard_of(full_mask, mesh, mask_pl)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    # The same arithmetic as the op itself, so the result is bit-equal to one process.
    out = dt._local_tensor.mul(mask).mul_(scale)
    return (
        DTensor(out, DTensorSpec(mesh, spec.placements, spec.shape)),
        DTensor(mask, DTensorSpec(mesh, mask_pl, spec.shape)),
    )


class _TorchRNG:
    """The ``RNGPrimitives`` of torch: the CPU default generator, its state broadcast over gloo/nccl."""

    @staticmethod
    def set_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def broadcast_rng_state(mesh: DeviceMesh) -> bool:
        mine = torch.get_rng_state()
        state = mine
        assert mesh.get_coordinate() is not None, "this rank is not part of the mesh"
        # The replicated layout of rank (0, ..., 0)'s state: one broadcast per mesh dim, run by
        # the plan walker.
        replicated = tuple(Replicate() for _ in range(mesh.ndim))
        plan = plan_distribute(mesh.shape, tuple(mine.shape), replicated, 0)
        state = run_plan(plan, mine, mesh, C.COLLECTIVES)
        changed = not torch.equal(state, mine)
        if changed:
            torch.set_rng_state(state)
        return changed


RNG = _TorchRNG()

__all__ = ["RNG", "run_random"]
