"""Pure planner: the cheapest sequence of collectives that changes one layout into another.

A state is the tuple of placements (one per mesh dim).  One step changes the placement of one
mesh dim and costs the elements it moves per rank:

=====================  ===============  ==========================
change on mesh dim k   collective       elements moved per rank
=====================  ===============  ==========================
Shard(i) -> Replicate  all_gather       (n-1) * local
Partial -> Replicate   all_reduce       2 (n-1)/n * local
Partial -> Shard(i)    reduce_scatter   (n-1)/n * local
Shard(i) -> Shard(j)   all_to_all       (n-1)/n * local
Replicate -> Shard(i)  chunk (local)    0
Replicate -> Partial   local            0
=====================  ===============  ==========================

``local`` is the local element count *before* the step on the rank holding the largest shard
(mesh coordinate 0): uneven shards are padded to that size where a collective needs equal pieces
(all_gather, reduce_scatter, all_to_all), so the cost is what the collective really moves, padding
included.  The order of steps across mesh dims matters ([P, S] -> [R, R] reduces the small shard
before gathering).  Dijkstra over states picks the minimum total; a small per-step charge prefers
shorter plans among equals.  Mesh dims shard a tensor dim in mesh order, so a step on mesh dim k
may only touch tensor dim d when no later mesh dim currently shards d.  Partials of different
reduce ops on one tensor are refused (max does not commute with sum), except sum with avg, which
do commute.  Plans are cached.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard, check_partials
from hp_dtensor.shard_geometry import check_shard_dims, chunk_size, max_local_shape

_STEP_CHARGE = 1e-3  # tie-breaker, in elements


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One collective (or local op) on one mesh dim."""

    mesh_dim: int
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | chunk | to_partial
    src: Placement
    dst: Placement

    def __str__(self) -> str:
        return f"{self.kind}[mesh {self.mesh_dim}]: {self.src} -> {self.dst}"


@dataclass(frozen=True, slots=True)
class RedistributePlan:
    steps: tuple[PlanStep, ...]
    cost: float  # elements moved per rank (on the rank with the largest shard)
    global_shape: tuple[int, ...] = ()  # what the plan was made for: the walker sizes uneven
    src: tuple[Placement, ...] = ()  # shards (and their padding) from it

    def collectives(self) -> list[str]:
        return [s.kind for s in self.steps if s.kind not in ("chunk", "to_partial")]


def _step_kind(src: Placement, dst: Placement) -> str | None:
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        if isinstance(dst, Shard):
            return "all_to_all"
        return None  # Shard -> Partial goes through Replicate
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce"
        if isinstance(dst, Shard):
            return "reduce_scatter"
        return None
    if isinstance(dst, Shard):
        return "chunk"
    if isinstance(dst, Partial):
        return "to_partial"
    return None


def _step_cost(kind: str, n: int, local_numel: int) -> float:
    """Elements one rank moves for a step on a local block of ``local_numel`` (already padded)."""
    if kind == "all_gather":
        return (n - 1) * local_numel
    if kind == "all_reduce":
        return 2 * (n - 1) / n * local_numel
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * local_numel
    return 0.0


def padded_step_numel(local: tuple[int, ...], kind: str, n: int, src: Placement, dst: Placement) -> int:
    """Elements of the (padded) block a collective of ``kind`` sends, from the local shape before
    the step: a scattered dim is padded to a multiple of ``n``."""
    shape = list(local)
    if kind in ("reduce_scatter", "all_to_all") and isinstance(dst, Shard):
        shape[dst.dim] = chunk_size(shape[dst.dim], n) * n
    return math.prod(shape)


def _mixed(placements: tuple[Placement, ...]) -> bool:
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    return len(ops) > 1 and ops != {"sum", "avg"}


def _touched_dims(src: Placement, dst: Placement) -> list[int]:
    return [p.dim for p in (src, dst) if isinstance(p, Shard)]


def _valid(state: tuple[Placement, ...], k: int, src: Placement, dst: Placement) -> bool:
    for d in _touched_dims(src, dst):
        if any(isinstance(p, Shard) and p.dim == d for p in state[k + 1 :]):
            return False
    return True


def _candidates(k: int, tensor_ndim: int, src: Placement, dst: Placement) -> list[Placement]:
    cands: list[Placement] = [Replicate()]
    cands += [Shard(d) for d in range(tensor_ndim)]
    for p in (src, dst):
        if isinstance(p, Partial) and p not in cands:
            cands.append(p)
    return cands


@lru_cache(maxsize=4096)
def plan_redistribute(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
) -> RedistributePlan:
    """Cheapest plan from ``src`` to ``dst`` placements; raises ``ValueError`` if none exists."""
    if len(src) != len(mesh_shape) or len(dst) != len(mesh_shape):
        raise ValueError(
            f"placements {src} -> {dst} do not match a {len(mesh_shape)}-D mesh of shape {mesh_shape}"
        )
    check_shard_dims(global_shape, src)
    check_shard_dims(global_shape, dst)
    check_partials(src)
    check_partials(dst)
    if src == dst:
        return RedistributePlan((), 0.0, global_shape, src)
    ndim = len(global_shape)
    options = [_candidates(k, ndim, src[k], dst[k]) for k in range(len(mesh_shape))]
    counter = itertools.count()
    best: dict[tuple[Placement, ...], float] = {src: 0.0}
    heap: list[tuple[float, int, tuple[Placement, ...], tuple[PlanStep, ...]]] = [
        (0.0, next(counter), src, ())
    ]
    while heap:
        cost, _, state, steps = heapq.heappop(heap)
        if state == dst:
            return RedistributePlan(steps, cost - _STEP_CHARGE * len(steps), global_shape, src)
        if cost > best.get(state, math.inf):
            continue
        local = max_local_shape(global_shape, mesh_shape, state)
        for k, cur in enumerate(state):
            for nxt in options[k]:
                if nxt == cur:
                    continue
                kind = _step_kind(cur, nxt)
                if kind is None or not _valid(state, k, cur, nxt):
                    continue
                new_state = state[:k] + (nxt,) + state[k + 1 :]
                if _mixed(new_state):
                    continue
                numel = padded_step_numel(local, kind, mesh_shape[k], cur, nxt)
                new_cost = cost + _step_cost(kind, mesh_shape[k], numel) + _STEP_CHARGE
                if new_cost < best.get(new_state, math.inf):
                    best[new_state] = new_cost
                    heapq.heappush(
                        heap,
                        (new_cost, next(counter), new_state, steps + (PlanStep(k, kind, cur, nxt),)),
                    )
    raise ValueError(f"no redistribute plan from {src} to {dst} on mesh {mesh_shape} for shape {global_shape}")
