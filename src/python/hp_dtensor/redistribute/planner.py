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
before gathering).  Each collective also pays a fixed latency (``CostModel``): a plan with more
collectives wins only when the bytes it saves outweigh their start-up cost, so small tensors move
in as few collectives as torch uses and large ones take the byte-cheapest route.  A step the walker
skips (a mesh dim of one rank, an empty block) issues nothing and pays no latency.  Dijkstra over
states picks the minimum total; a small per-step charge prefers shorter plans among equals.  Mesh dims shard a tensor dim in mesh order, so a step on mesh dim k
may only touch tensor dim d when no later mesh dim currently shards d.  Partials of different
reduce ops on one tensor are refused (max does not commute with sum), except sum with avg, which
do commute.  Plans are cached.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from hp_dtensor.layout.shard_geometry import check_shard_dims, chunk_size, is_even, max_local_shape
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard, check_partials

_STEP_CHARGE = 1e-3  # tie-breaker, in elements

# The fixed cost of one collective, in bytes a rank could have sent in the same time, fitted by
# ``benchmarks/redistribute_latency.py`` (t = latency + bytes / bandwidth per collective kind).
# On 2-core CPU machines with gloo under load (two runs), the fits ranged 0.16-1.3 MB on groups
# of 2 and 0.7-5.7 MB on groups of 4 (medians over the kinds 0.32-0.39 MB on 2 ranks, 0.48-0.84
# MB on 4).  The constant sits near the low end: a plan keeps fewer collectives only where every
# fit says the bytes it gives up cost less than the calls it saves.  ``set_cost_model`` overrides it.
GLOO_CPU_LATENCY_BYTES = 262_144.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """What the planner minimises: bytes moved per rank plus ``latency_bytes`` per collective.
    ``latency_bytes=0`` is the pure bytes model (fewest bytes, whatever the number of calls)."""

    latency_bytes: float = GLOO_CPU_LATENCY_BYTES

    def __post_init__(self) -> None:
        if not (self.latency_bytes >= 0 and math.isfinite(self.latency_bytes)):
            raise ValueError(f"CostModel.latency_bytes must be a finite number >= 0, got {self.latency_bytes!r}")


BYTES_ONLY = CostModel(0.0)
_cost_model = CostModel()


def cost_model() -> CostModel:
    """The model plans are made with (``set_cost_model`` changes it)."""
    return _cost_model


def set_cost_model(model: CostModel) -> None:
    """Plan with ``model`` from now on, e.g. the latency of another fabric measured with the
    benchmark; plans already made for the old model are dropped."""
    global _cost_model
    if not isinstance(model, CostModel):
        raise TypeError(f"set_cost_model takes a CostModel, got {type(model).__name__}")
    _cost_model = model
    _plan.cache_clear()
    _plan_distribute.cache_clear()


class StepKind(enum.StrEnum):
    """What one plan step does on its mesh dim.  A ``StrEnum``: its value is the collective's
    name as ``CommDebugMode`` counts it."""

    ALL_GATHER = "all_gather"  # Shard -> Replicate
    ALL_REDUCE = "all_reduce"  # Partial -> Replicate
    REDUCE_SCATTER = "reduce_scatter"  # Partial -> Shard
    ALL_TO_ALL = "all_to_all"  # Shard(i) -> Shard(j)
    CHUNK = "chunk"  # Replicate -> Shard, local
    TO_PARTIAL = "to_partial"  # Replicate -> Partial, local
    # Only in plans that lay out a source rank's whole tensor (``plan_distribute``):
    SCATTER = "scatter"  # Replicate -> Shard, each rank's piece from the source
    BROADCAST = "broadcast"  # Replicate -> Replicate, the source's value to every rank

    @property
    def is_collective(self) -> bool:
        return self not in (StepKind.CHUNK, StepKind.TO_PARTIAL)


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One collective (or local op) on one mesh dim."""

    mesh_dim: int
    kind: StepKind
    src: Placement
    dst: Placement

    def __str__(self) -> str:
        return f"{self.kind}[mesh {self.mesh_dim}]: {self.src} -> {self.dst}"


@dataclass(frozen=True, slots=True)
class RedistributePlan:
    steps: tuple[PlanStep, ...]
    cost: float  # elements moved per rank (on the rank with the largest shard), latency not included
    global_shape: tuple[int, ...] = ()  # what the plan was made for: the walker sizes uneven
    src: tuple[Placement, ...] = ()  # shards (and their padding) from it
    source: int | None = None  # SCATTER/BROADCAST steps: the group rank (on each mesh dim) sending

    def collectives(self) -> list[StepKind]:
        return [s.kind for s in self.steps if s.kind.is_collective]


def step_kind(src: Placement, dst: Placement) -> StepKind | None:
    """The one step that changes ``src`` into ``dst`` on a mesh dim; ``None`` when it takes two
    (through ``Replicate``) or none."""
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return StepKind.ALL_GATHER
        if isinstance(dst, Shard):
            return StepKind.ALL_TO_ALL
        return None  # Shard -> Partial goes through Replicate
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return StepKind.ALL_REDUCE
        if isinstance(dst, Shard):
            return StepKind.REDUCE_SCATTER
        return None
    if isinstance(dst, Shard):
        return StepKind.CHUNK
    if isinstance(dst, Partial):
        return StepKind.TO_PARTIAL
    return None


_PER_RANK_FACTOR: dict[str, Callable[[int], float]] = {
    StepKind.ALL_GATHER: lambda n: float(n - 1),
    StepKind.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    StepKind.REDUCE_SCATTER: lambda n: (n - 1) / n,
    StepKind.ALL_TO_ALL: lambda n: (n - 1) / n,
}


def step_cost(kind: str, n: int, local_numel: int) -> float:
    """Elements one rank moves for a step of ``kind`` (a ``StepKind``; local steps and anything
    else cost 0) on a mesh dim of ``n`` ranks and a local block of ``local_numel`` (already
    padded): the planner's cost model, shared with the sharding rules that weigh layouts."""
    factor = _PER_RANK_FACTOR.get(kind)
    return 0.0 if factor is None else factor(n) * local_numel


def padded_step_numel(local: tuple[int, ...], kind: StepKind, n: int, src: Placement, dst: Placement) -> int:
    """Elements of the (padded) block a collective of ``kind`` sends, from the local shape before
    the step: a scattered dim is padded to a multiple of ``n``."""
    shape = list(local)
    if kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_TO_ALL) and isinstance(dst, Shard):
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


def plan_redistribute(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    itemsize: int = 4,
    model: CostModel | None = None,
) -> RedistributePlan:
    """Cheapest plan from ``src`` to ``dst`` placements for elements of ``itemsize`` bytes under
    ``model`` (default: ``cost_model()``); raises ``ValueError`` if none exists."""
    return _plan(mesh_shape, global_shape, src, dst, itemsize, _cost_model if model is None else model)


@lru_cache(maxsize=4096)
def _plan(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    itemsize: int,
    model: CostModel,
) -> RedistributePlan:
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
    # Between even layouts, stay even: the plans of backends without uneven support stay valid,
    # and the padding an uneven detour costs rarely pays.
    even_only = is_even(global_shape, mesh_shape, src) and is_even(global_shape, mesh_shape, dst)
    options = [_candidates(k, ndim, src[k], dst[k]) for k in range(len(mesh_shape))]
    if itemsize <= 0:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    latency = model.latency_bytes / itemsize  # in elements, the unit of the byte costs
    counter = itertools.count()
    best: dict[tuple[Placement, ...], float] = {src: 0.0}
    # (search cost, tie-break, state, steps, elements moved)
    heap: list[tuple[float, int, tuple[Placement, ...], tuple[PlanStep, ...], float]] = [
        (0.0, next(counter), src, (), 0.0)
    ]
    while heap:
        cost, _, state, steps, moved = heapq.heappop(heap)
        if state == dst:
            return RedistributePlan(steps, moved, global_shape, src)
        if cost > best.get(state, math.inf):
            continue
        local = max_local_shape(global_shape, mesh_shape, state)
        for k, cur in enumerate(state):
            for nxt in options[k]:
                if nxt == cur:
                    continue
                kind = step_kind(cur, nxt)
                if kind is None or not _valid(state, k, cur, nxt):
                    continue
                new_state = state[:k] + (nxt,) + state[k + 1 :]
                if _mixed(new_state) or (even_only and not is_even(global_shape, mesh_shape, new_state)):
                    continue
                numel = padded_step_numel(local, kind, mesh_shape[k], cur, nxt)
                elements = step_cost(kind, mesh_shape[k], numel)
                # the latency is paid only by a collective the walker really issues: it skips
                # steps on a mesh dim of one rank and groups whose (padded) block is empty
                issued = kind.is_collective and mesh_shape[k] > 1 and numel > 0
                new_cost = cost + elements + _STEP_CHARGE + (latency if issued else 0.0)
                if new_cost < best.get(new_state, math.inf):
                    best[new_state] = new_cost
                    step = PlanStep(k, kind, cur, nxt)
                    heapq.heappush(heap, (new_cost, next(counter), new_state, steps + (step,), moved + elements))
    raise ValueError(f"no redistribute plan from {src} to {dst} on mesh {mesh_shape} for shape {global_shape}")


def plan_distribute(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    source: int | None,
) -> RedistributePlan:
    """Lay a whole tensor, present on every rank, out as ``placements``: the plan from
    ``Replicate`` on every mesh dim.  ``source=None``: every rank keeps its own copy's piece (local
    steps only).  ``source=i``: group rank ``i`` of each mesh dim is the truth, so each chunk
    becomes a scatter from it, and every mesh dim not sharded gets a broadcast from it.  Scatters
    run first and broadcasts after them, on the smaller pieces; a Partial dim zeroes its
    non-root ranks only after its broadcast.  (A step along mesh dim k takes the value of the
    rank with coordinate ``i`` on k, so the result is the source rank's, whatever the order.)"""
    return _plan_distribute(mesh_shape, global_shape, placements, source, _cost_model)


@lru_cache(maxsize=1024)
def _plan_distribute(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    source: int | None,
    model: CostModel,
) -> RedistributePlan:
    replicated = tuple(Replicate() for _ in mesh_shape)
    base = plan_redistribute(mesh_shape, global_shape, replicated, placements, model=model)
    if source is None:
        return base
    chunks = [PlanStep(s.mesh_dim, StepKind.SCATTER, s.src, s.dst) for s in base.steps if s.kind is StepKind.CHUNK]
    sent = {s.mesh_dim for s in chunks}
    broadcasts = [
        PlanStep(k, StepKind.BROADCAST, Replicate(), Replicate()) for k in range(len(mesh_shape)) if k not in sent
    ]
    partials = [s for s in base.steps if s.kind is StepKind.TO_PARTIAL]
    return RedistributePlan(tuple(chunks + broadcasts + partials), base.cost, global_shape, replicated, source)
