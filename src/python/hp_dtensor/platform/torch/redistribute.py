"""Run a planned redistribution on a local tensor, and its differentiable wrappers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


class Redistribute(torch.autograd.Function):
    """DTensor -> DTensor with new placements; backward redistributes the gradient back."""

    @staticmethod
    def forward(ctx: Any, dt: Any, mesh: Any, dst: tuple[Placement, ...]) -> Any:  # type: ignore[override]
        from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec

        spec = dt._spec
        ctx.src_spec = spec
        local = redistribute_local(dt._local_tensor, mesh, spec.shape, spec.placements, dst)
        if local is dt._local_tensor:
            local = local.view_as(local)
        return DTensor(local, DTensorSpec(mesh, dst, spec.shape))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec

        src = ctx.src_spec
        target = grad_placements(src.placements)
        g = grad._spec
        local = redistribute_local(grad._local_tensor, g.mesh, g.shape, g.placements, target)
        return DTensor(local, DTensorSpec(g.mesh, target, g.shape)), None, None


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: Any) -> Any:  # type: ignore[override]
        from hp_dtensor.platform.torch.dtensor import DTensor

        ctx.spec = spec
        return DTensor(local.view_as(local), spec)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        spec = ctx.spec
        target = grad_placements(spec.placements)
        g = grad._spec
        local = redistribute_local(grad._local_tensor, g.mesh, g.shape, g.placements, target)
        return local, None


class ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: Any, grad_pl: tuple[Placement, ...] | None) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = dt._spec
        ctx.grad_pl = grad_pl
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec

        spec = ctx.spec
        pl = ctx.grad_pl if ctx.grad_pl is not None else spec.placements
        return DTensor(grad.contiguous(), DTensorSpec(spec.mesh, pl, spec.shape)), None
