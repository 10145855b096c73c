"""Carry out a ``RedistributePlan`` on one rank's local tensor, framework-neutral.

The step semantics live here once: ``chunk`` keeps this rank's slice, ``to_partial`` keeps a sum
on coordinate 0 and zeros elsewhere (avg/max/min keep the value), the rest are one collective along
the step's mesh dim.  Each platform supplies the primitives (``PlanPrimitives``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from hp_dtensor.placement_types import Partial, Shard
from hp_dtensor.redistribute_planner import RedistributePlan

if TYPE_CHECKING:
    from hp_dtensor.device_mesh import DeviceMesh


class PlanPrimitives(Protocol):
    """Local ops and collectives along one mesh dim; ``n`` is the dim's size and ``index`` this
    rank's coordinate on it."""

    def chunk(self, t: Any, dim: int, n: int, index: int) -> Any: ...

    def zeros_like(self, t: Any) -> Any: ...

    def all_gather(self, t: Any, dim: int, group: Any, n: int, index: int) -> Any: ...

    def all_reduce(self, t: Any, op: str, group: Any, n: int, index: int) -> Any: ...

    def reduce_scatter(self, t: Any, dim: int, op: str, group: Any, n: int, index: int) -> Any: ...

    def all_to_all(self, t: Any, split_dim: int, concat_dim: int, group: Any, n: int, index: int) -> Any: ...


def run_plan(plan: RedistributePlan, local: Any, mesh: DeviceMesh, prims: PlanPrimitives) -> Any:
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    for step in plan.steps:
        k = step.mesh_dim
        n = mesh.shape[k]
        idx = coord[k]
        kind = step.kind
        if kind == "chunk":
            assert isinstance(step.dst, Shard)
            local = prims.chunk(local, step.dst.dim, n, idx)
            continue
        if kind == "to_partial":
            assert isinstance(step.dst, Partial)
            if step.dst.reduce_op == "sum" and idx != 0:
                local = prims.zeros_like(local)
            continue
        group = mesh.get_group(k)
        if kind == "all_gather":
            assert isinstance(step.src, Shard)
            local = prims.all_gather(local, step.src.dim, group, n, idx)
        elif kind == "all_reduce":
            assert isinstance(step.src, Partial)
            local = prims.all_reduce(local, step.src.reduce_op, group, n, idx)
        elif kind == "reduce_scatter":
            assert isinstance(step.src, Partial) and isinstance(step.dst, Shard)
            local = prims.reduce_scatter(local, step.dst.dim, step.src.reduce_op, group, n, idx)
        elif kind == "all_to_all":
            assert isinstance(step.src, Shard) and isinstance(step.dst, Shard)
            local = prims.all_to_all(local, step.dst.dim, step.src.dim, group, n, idx)
        else:  # pragma: no cover - the planner emits only the kinds above
            raise AssertionError(kind)
    return local
