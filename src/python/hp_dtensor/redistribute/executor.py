"""Carry out a ``RedistributePlan`` on one rank's local tensor, framework-neutral.

The step semantics live here once: ``chunk`` keeps this rank's slice, ``to_partial`` keeps a sum
on coordinate 0 and zeros elsewhere (avg/max/min keep the value), the rest are one collective along
the step's mesh dim.  Each platform supplies the primitives (``PlanPrimitives``).

Uneven shards (``torch.chunk``-style: full chunks first, then a short one, then empty ones) are
padded at the end of the dim to the full chunk size before a collective that needs equal pieces
and cut back after it.  Because every chunk before the short one is full, the real data of a
gathered dim is always its first ``size`` elements, so unpadding is one ``narrow`` from 0.  The
members of one mesh-dim group always agree on the padded shape (they differ only in their
coordinate on that dim), so a group whose padded block is empty skips the collective together,
as does a mesh dim of size 1.
"""

from __future__ import annotations

from typing import Any, Protocol

from hp_dtensor.layout.shard_geometry import chunk_size, chunk_size_and_offset, size_before
from hp_dtensor.placement_types import Partial, Placement, ReduceOp, Replicate, Shard, partials_replicated
from hp_dtensor.redistribute.planner import RedistributePlan, StepKind, plan_redistribute


class PlanMesh(Protocol):
    """What the walker reads of a mesh (``DeviceMesh`` is one): its topology and this rank's
    groups.  A Protocol, so the redistribute layer does not import the mesh, which reaches the
    platform."""

    @property
    def ndim(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def get_coordinate(self) -> tuple[int, ...] | None: ...

    def get_group(self, mesh_dim: int | str | None = None) -> Any: ...

    def group_ranks(self, mesh_dim: int) -> tuple[int, ...]: ...


class PlanPrimitives(Protocol):
    """Local ops and collectives along one mesh dim; ``n`` is the dim's size and ``index`` this
    rank's coordinate on it.  Collectives get equal pieces only (the walker pads)."""

    def chunk(self, t: Any, dim: int, n: int, index: int) -> Any: ...

    def narrow(self, t: Any, dim: int, start: int, length: int) -> Any: ...

    def pad(self, t: Any, dim: int, size: int) -> Any:
        """``t`` with zeros appended along ``dim`` up to ``size``."""
        ...

    def zeros_like(self, t: Any) -> Any: ...

    def all_gather(self, t: Any, dim: int, group: Any, n: int, index: int) -> Any: ...

    def all_reduce(self, t: Any, op: str, group: Any, n: int, index: int) -> Any: ...

    def reduce_scatter(self, t: Any, dim: int, op: str, group: Any, n: int, index: int) -> Any: ...

    def all_to_all(self, t: Any, split_dim: int, concat_dim: int, group: Any, n: int, index: int) -> Any: ...

    def broadcast(self, t: Any, src_index: int, group: Any, n: int, index: int, src_global_rank: int) -> Any: ...

    def scatter(self, t: Any, dim: int, src_index: int, group: Any, n: int, index: int, src_global_rank: int) -> Any:
        """Piece ``index`` of ``n`` equal pieces of ``dim`` of group rank ``src_index``'s ``t``
        (every rank passes a ``t`` of the same shape)."""
        ...


def _shape(t: Any) -> list[int]:
    return [int(s) for s in t.shape]


def _pad(prims: PlanPrimitives, t: Any, dim: int, size: int) -> Any:
    return t if _shape(t)[dim] == size else prims.pad(t, dim, size)


def _cut(prims: PlanPrimitives, t: Any, dim: int, size: int) -> Any:
    return t if _shape(t)[dim] == size else prims.narrow(t, dim, 0, size)


def _empty_result(prims: PlanPrimitives, t: Any, shape: list[int]) -> Any:
    """A zero-element tensor of ``shape`` made from ``t`` (which is zero-element too)."""
    out = t
    for d, s in enumerate(shape):
        if _shape(out)[d] > s:
            out = prims.narrow(out, d, 0, s)
        elif _shape(out)[d] < s:
            out = prims.pad(out, d, s)
    return out


def run_plan(plan: RedistributePlan, local: Any, mesh: PlanMesh, prims: PlanPrimitives) -> Any:
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    state: list[Placement] = list(plan.src)
    gshape = plan.global_shape
    # size_before(..., k, d): the size of tensor dim d that mesh dim k splits or gathers back at
    # this rank (the planner never lets a later mesh dim shard d while mesh dim k moves it)
    for step in plan.steps:
        k = step.mesh_dim
        n = mesh.shape[k]
        idx = coord[k]
        kind = step.kind

        if n == 1:
            pass  # a mesh dim of one rank: every step on it is the identity, nothing moves
        elif kind is StepKind.CHUNK:
            assert isinstance(step.dst, Shard)
            d = step.dst.dim
            size = size_before(gshape, mesh.shape, state, coord, k, d)
            if size % n == 0:
                local = prims.chunk(local, d, n, idx)
            else:
                length, start = chunk_size_and_offset(size, n, idx)
                local = prims.narrow(local, d, start, length)
        elif kind is StepKind.TO_PARTIAL:
            assert isinstance(step.dst, Partial)
            if step.dst.reduce_op == "sum" and idx != 0:
                local = prims.zeros_like(local)
        elif kind is StepKind.ALL_GATHER:
            assert isinstance(step.src, Shard)
            d = step.src.dim
            size = size_before(gshape, mesh.shape, state, coord, k, d)
            full = chunk_size(size, n)
            shape = _shape(local)
            shape[d] = full
            if 0 in shape:
                shape[d] = size
                local = _empty_result(prims, local, shape)
            else:
                local = _pad(prims, local, d, full)
                local = prims.all_gather(local, d, mesh.get_group(k), n, idx)
                local = _cut(prims, local, d, size)
        elif kind is StepKind.ALL_REDUCE:
            assert isinstance(step.src, Partial)
            if 0 not in _shape(local):
                local = prims.all_reduce(local, step.src.reduce_op, mesh.get_group(k), n, idx)
        elif kind is StepKind.REDUCE_SCATTER:
            assert isinstance(step.src, Partial) and isinstance(step.dst, Shard)
            d = step.dst.dim
            size = _shape(local)[d]
            length = chunk_size_and_offset(size, n, idx)[0]
            shape = _shape(local)
            shape[d] = chunk_size(size, n) * n
            if 0 in shape:
                shape[d] = length
                local = _empty_result(prims, local, shape)
            else:
                local = _pad(prims, local, d, shape[d])
                local = prims.reduce_scatter(local, d, step.src.reduce_op, mesh.get_group(k), n, idx)
                local = _cut(prims, local, d, length)
        elif kind is StepKind.ALL_TO_ALL:
            assert isinstance(step.src, Shard) and isinstance(step.dst, Shard)
            i, j = step.src.dim, step.dst.dim
            size_i, size_j = size_before(gshape, mesh.shape, state, coord, k, i), _shape(local)[j]
            full_i, full_j = chunk_size(size_i, n), chunk_size(size_j, n)
            length_j = chunk_size_and_offset(size_j, n, idx)[0]
            shape = _shape(local)
            shape[i], shape[j] = full_i, full_j * n
            if 0 in shape:
                shape[i], shape[j] = size_i, length_j
                local = _empty_result(prims, local, shape)
            else:
                local = _pad(prims, _pad(prims, local, i, full_i), j, full_j * n)
                local = prims.all_to_all(local, j, i, mesh.get_group(k), n, idx)
                local = _cut(prims, _cut(prims, local, i, size_i), j, length_j)
        elif kind is StepKind.BROADCAST:
            assert plan.source is not None
            if 0 not in _shape(local):
                src_global = mesh.group_ranks(k)[plan.source]
                local = prims.broadcast(local, plan.source, mesh.get_group(k), n, idx, src_global)
        elif kind is StepKind.SCATTER:
            assert isinstance(step.dst, Shard) and plan.source is not None
            d = step.dst.dim
            size = size_before(gshape, mesh.shape, state, coord, k, d)
            full = chunk_size(size, n)
            length, start = chunk_size_and_offset(size, n, idx)
            shape = _shape(local)
            shape[d] = full
            if 0 in shape:  # the whole group holds nothing here: no collective
                local = prims.narrow(local, d, start, length)
            else:
                src_global = mesh.group_ranks(k)[plan.source]
                local = _pad(prims, local, d, full * n)
                local = prims.scatter(local, d, plan.source, mesh.get_group(k), n, idx, src_global)
                local = _cut(prims, local, d, length)
        else:  # pragma: no cover - the planner emits only the kinds above
            raise AssertionError(kind)
        state[k] = step.dst
    return local


def redistribute_local(
    local: Any,
    mesh: PlanMesh,
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    prims: PlanPrimitives,
) -> Any:
    """Apply the cheapest plan from ``src`` to ``dst`` to this rank's ``local`` shard (both
    frameworks' tensors report their element size as ``itemsize``, which prices the plan)."""
    if src == dst:
        return local
    return run_plan(plan_redistribute(mesh.shape, global_shape, src, dst, int(local.itemsize)), local, mesh, prims)


def grad_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Layout of the gradient of a value laid out as ``placements``: a gradient flowing back to a
    ``Partial`` value is the same on every rank, so ``Replicate`` (torch's convention)."""
    return partials_replicated(placements)


def reduce_over(local: Any, mesh: PlanMesh, mesh_dims: tuple[int, ...], op: ReduceOp, prims: PlanPrimitives) -> Any:
    """``local`` reduced with ``op`` (sum, avg, max, min) over the ranks of ``mesh_dims``, the
    result on each of them: the plan from ``Partial(op)`` on those dims to ``Replicate``, one
    all_reduce per dim.  How layout-internal reductions (a softmax's row max and sum over vocab
    shards, a replicated input's gradient terms) reach the collectives: through the walker."""
    src = tuple(Partial(op) if k in mesh_dims else Replicate() for k in range(mesh.ndim))
    dst = tuple(Replicate() for _ in range(mesh.ndim))
    return redistribute_local(local, mesh, tuple(_shape(local)), src, dst, prims)
