"""Run a planned redistribution on a local tensor (the DTensor's autograd adapters are in ``dtensor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hp_dtensor.placement_types import Partial, Placement, Replicate
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.redistribute_exec import run_plan
from hp_dtensor.redistribute_planner import plan_redistribute

if TYPE_CHECKING:
    from hp_dtensor.device_mesh import DeviceMesh


def redistribute_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
) -> torch.Tensor:
    """Apply the cheapest plan from ``src`` to ``dst`` to this rank's ``local`` shard."""
    if src == dst:
        return local
    return run_plan(plan_redistribute(mesh.shape, global_shape, src, dst), local, mesh, _PRIMITIVES)


_PRIMITIVES = C.COLLECTIVES


def grad_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A gradient flowing back to a Partial value is the same on every rank: Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
