"""The DTensor API written once for every backend.

A backend's ``DTensor`` class inherits ``DTensorMethods`` and supplies primitives only: how to
run a differentiable layout change (``_redistribute``) and ``to_local``.  The argument rules of
``redistribute``, ``full_tensor``, ``from_local`` and ``distribute_tensor`` live here, so the same
call fails the same way on torch and MindSpore, and ``distribute_tensor``'s layout is the plan from ``Replicate`` that the one plan
walker runs (``redistribute_planner.plan_distribute``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from hp_dtensor.layout.dtensor_spec import (
    DTensorSpec,
    check_partial_dtype,
    check_src_data_rank,
    distribute_placements,
    from_local_spec,
    redistribute_target,
    resolve_mesh,
)
from hp_dtensor.placement_types import Placement, Replicate
from hp_dtensor.redistribute.executor import PlanPrimitives, run_plan
from hp_dtensor.redistribute.planner import plan_distribute

if TYPE_CHECKING:
    from typing import Self

    from hp_dtensor.device_mesh import DeviceMesh


class DTensorMethods:
    """The framework-neutral half of a DTensor: its layout and the layout-changing API."""

    _spec: DTensorSpec
    dtype: Any  # the framework tensor's own

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | Placement | None = None,
        *,
        async_op: bool = False,
    ) -> Self:
        """Change placements on the same mesh with the cheapest collective plan (differentiable)."""
        if isinstance(device_mesh, (Placement, list, tuple)) and placements is None:
            device_mesh, placements = None, device_mesh  # redistribute(placements) positional form
        spec = self._spec
        dst = redistribute_target(spec, device_mesh, placements, uneven=True)
        self._check_placements(dst)
        if dst == spec.placements:
            return self
        return self._redistribute(dst)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> Any:
        """The whole tensor on every rank (differentiable)."""
        rep = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return rep.to_local(grad_placements=grad_placements)

    # ----- what a backend supplies -----
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> Any:
        raise NotImplementedError

    def _check_placements(self, placements: tuple[Placement, ...]) -> None:
        """Refuse ``placements`` this tensor's dtype cannot hold (``Partial('avg')`` on integers);
        the check reads both frameworks' dtype names (``torch.int64``, ``Int64``)."""
        check_partial_dtype(placements, str(self.dtype))

    def _redistribute(self, dst: tuple[Placement, ...]) -> Self:
        """A new DTensor of this value laid out as ``dst`` (a differentiable layout change)."""
        raise NotImplementedError


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def from_local_checked(
    local_shape: Sequence[int],
    dtype: str,
    mesh: DeviceMesh,
    placements: Sequence[Placement] | Placement | None,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
) -> DTensorSpec:
    """The spec ``from_local`` gives a shard of ``local_shape``, with every argument rule checked:
    placements fit the mesh and the dtype, ``shape`` (uneven shards) fits this rank's shard, and
    ``stride``, when given, is the contiguous stride of the global shape."""
    spec = from_local_spec(local_shape, mesh, placements, shape, uneven=True)
    check_partial_dtype(spec.placements, dtype)
    if stride is not None and tuple(int(s) for s in stride) != contiguous_strides(spec.shape):
        raise ValueError(
            f"stride={tuple(stride)} is not the contiguous stride {contiguous_strides(spec.shape)} of "
            f"shape {spec.shape}: DTensors describe their global tensor as contiguous"
        )
    return spec


def distribute_checked(
    is_dtensor: bool,
    global_shape: tuple[int, ...],
    dtype: str,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | Placement | None,
    src_data_rank: int | None,
) -> DTensorSpec:
    """The spec ``distribute_tensor`` lays a tensor of ``global_shape`` out with, every argument
    rule checked (mesh, placements, dtype, ``src_data_rank``, this rank in the mesh)."""
    mesh = resolve_mesh(device_mesh, "distribute_tensor")
    if is_dtensor:
        raise ValueError("distribute_tensor got a DTensor; use .redistribute() to change its placements")
    pl = distribute_placements(global_shape, mesh, placements, uneven=True)
    check_partial_dtype(pl, dtype)
    check_src_data_rank(src_data_rank, mesh)
    if mesh.get_coordinate() is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not part of {mesh}")
    return DTensorSpec(mesh, pl, global_shape)


def distribute_local(whole: Any, spec: DTensorSpec, src_data_rank: int | None, prims: PlanPrimitives) -> Any:
    """This rank's shard of ``whole`` laid out as ``spec``: the plan from ``Replicate``, with the
    source's values scattered and broadcast when ``src_data_rank`` is set."""
    mesh = spec.mesh
    plan = plan_distribute(mesh.shape, spec.shape, spec.placements, src_data_rank)
    return run_plan(plan, whole, mesh, prims)


class DistributePrimitives(Protocol):
    """What ``distribute_tensor`` needs of a backend besides the plan walker's collectives."""

    @property
    def tensor_type(self) -> type[Any]:
        """The framework's tensor class (errors name it by ``tensor_name``, ``torch.Tensor``)."""
        ...

    @property
    def tensor_name(self) -> str: ...

    @property
    def dtensor_type(self) -> type[Any]: ...

    @property
    def collectives(self) -> PlanPrimitives: ...

    def source(self, tensor: Any) -> tuple[Any, bool]:
        """``tensor``'s whole value, materialized and detached from autograd, and whether it holds
        data to send (a meta tensor does not: its layout never communicates)."""
        ...

    def layout_context(self) -> AbstractContextManager[Any]:
        """The context the layout's local ops run in (no autograd recording, no DTensor dispatch)."""
        ...

    def shard(self, local: Any, tensor: Any, spec: DTensorSpec) -> Any:
        """The DTensor of ``spec`` holding ``local`` as its own storage (never ``tensor``'s)."""
        ...


def distribute_with(
    prims: DistributePrimitives,
    tensor: Any,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | Placement | None,
    src_data_rank: int | None,
) -> Any:
    """``distribute_tensor`` on a backend's primitives: the arguments checked, then this rank's
    shard by the plan from ``Replicate`` (see ``distribute_local``)."""
    if not isinstance(tensor, prims.tensor_type):
        raise TypeError(f"distribute_tensor expects a {prims.tensor_name}, got {type(tensor).__name__}")
    spec = distribute_checked(
        isinstance(tensor, prims.dtensor_type), tuple(int(n) for n in tensor.shape), str(tensor.dtype),
        device_mesh, placements, src_data_rank,
    )
    whole, has_data = prims.source(tensor)
    with prims.layout_context():
        local = distribute_local(whole, spec, src_data_rank if has_data else None, prims.collectives)
        return prims.shard(local, tensor, spec)
