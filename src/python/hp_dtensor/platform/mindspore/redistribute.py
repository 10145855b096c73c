"""Run a planned redistribution on a local MindSpore tensor, and its autograd duals.

The gradient convention they keep (torch's) and the bookkeeping of per-rank gradient terms are
in ``hp_dtensor.sharding.local_grads``: MindSpore's autograd runs on local tensors;
``Redistribute.backward`` runs the planner's plan between the gradient layouts, and
``AllReduceGrad`` sums the per-rank contributions of a replicated input that fed a rank-dependent
output (Megatron's "f").  The one exception: a replicated value made by ``redistribute`` may
collect its gradient as per-rank terms (``GradLayout``), so that its own backward sums them once
-- the torch backend gets the same effect from Partial gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mindspore as ms
from mindspore import Tensor, ops
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.placement_types import Partial, Placement
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.redistribute import executor as redistribute_exec
from hp_dtensor.redistribute.executor import grad_placements as grad_placements  # re-exported

if TYPE_CHECKING:
    from hp_dtensor.device_mesh import DeviceMesh


def redistribute_local(
    local: Any,
    mesh: DeviceMesh,
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
) -> Tensor:
    """Apply the cheapest plan from ``src`` to ``dst`` to this rank's ``local`` shard."""
    return redistribute_exec.redistribute_local(C._plain(local), mesh, global_shape, src, dst, C.COLLECTIVES)


def grad_back(grad: Any, mesh: DeviceMesh, global_shape: tuple[int, ...],
              src: tuple[Placement, ...], dst: tuple[Placement, ...], partial: tuple[int, ...] = ()) -> Tensor:
    """The gradient of a ``src`` value from the gradient of its ``dst`` redistribution (held as
    per-rank terms on the mesh dims in ``partial``)."""
    incoming = tuple(Partial("sum") if k in partial else p for k, p in enumerate(grad_placements(dst)))
    return redistribute_local(C._plain(grad), mesh, global_shape, incoming, grad_placements(src))


class Redistribute(ms._Function):  # type: ignore[misc]
    """Local shard in ``src`` -> local shard in ``dst``; backward redistributes the gradient back."""

    @staticmethod
    def forward(ctx: Any, local: Any, mesh: Any, global_shape: Any, src: Any, dst: Any, layout: Any) -> Tensor:
        ctx.meta = (mesh, global_shape, src, dst, layout)
        with NoFallbackGuard():
            plain = C._plain(local)
            out = redistribute_local(plain, mesh, global_shape, src, dst)
            # A Function must not hand back its input's storage (rank 0's to_partial keeps it).
            return out if out is not plain else C.copy(out)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        mesh, global_shape, src, dst, layout = ctx.meta
        with NoFallbackGuard():
            g = grad_back(grad, mesh, global_shape, src, dst, layout.partial or ())
            return g, None, None, None, None, None


class _GradOnly(ms._Function):  # type: ignore[misc]
    """Identity forward over ``(local, mesh, mesh_dims)``; subclasses change only the gradient."""

    @staticmethod
    def forward(ctx: Any, local: Any, mesh: Any, mesh_dims: Any) -> Tensor:
        ctx.meta = (mesh, mesh_dims)
        return local


class AllReduceGrad(_GradOnly):
    """Backward sums the gradient over the given mesh dims.  Put on a replicated input whose op
    gives each rank a different output: each rank's local backward then holds one term of the
    input's gradient."""

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        mesh, mesh_dims = ctx.meta
        with NoFallbackGuard():
            g = redistribute_exec.reduce_over(C._plain(grad), mesh, tuple(mesh_dims), "sum", C.COLLECTIVES)
            return g, None, None


class KeepGradOnRoot(_GradOnly):
    """Backward keeps the gradient on coordinate 0 of the given mesh dims and zeros it elsewhere:
    a whole gradient becomes per-rank terms with the same sum (exact), for a consumer of a value
    whose gradient is collected as terms (``GradLayout``)."""

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        mesh, mesh_dims = ctx.meta
        with NoFallbackGuard():
            g = C._plain(grad)
            if any(mesh.get_coordinate()[k] != 0 for k in mesh_dims):
                g = ops.zeros_like(g)
            return g, None, None


class ScaleGrad(ms._Function):  # type: ignore[misc]
    """Identity forward over ``(local, factor)``; backward multiplies the gradient by ``factor``
    (the 1/n of an input whose op makes a ``Partial("avg")`` term, see ``dispatch.py``)."""

    @staticmethod
    def forward(ctx: Any, local: Any, factor: Any) -> Tensor:
        ctx.factor = factor
        return local

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        with NoFallbackGuard():
            return C._plain(grad) * ctx.factor, None
