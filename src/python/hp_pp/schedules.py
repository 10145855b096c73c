"""Pipeline schedules as pure plans: the ordered actions of every pp rank for one step.

A schedule first fixes each rank's compute order (which F/B/I/W of which microbatch and virtual
stage runs when); ``with_communication`` then puts a RECV right before every compute that needs
data from another rank and a SEND right after every compute that produces data for one.  Sends
are asynchronous, receives block until their data is there, so a plan runs without deadlock when
``simulate`` completes it; ``simulate`` also counts the activations each stage holds at its peak
and the schedule's idle time (the bubble) under unit-cost compute.  Pure: no framework.

Virtual stage ``v`` runs on pp rank ``v % pp`` (segment ``k`` of rank ``i`` is ``k * pp + i``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hp_pp.actions import Action, ActionKind
from hp_pp.errors import PipelineConfigError
from hp_pp.split import stage_rank

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


class ScheduleKind(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"  # 1F1B with the backward split into I and W (ZB-H1)

    @property
    def interleaved(self) -> bool:
        return self is ScheduleKind.INTERLEAVED_1F1B


@dataclass(frozen=True)
class PipelinePlan:
    """Every rank's actions for one step (``actions[r]``), and the sizes they were made for."""

    kind: ScheduleKind
    pp: int
    num_virtual: int
    n_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def rank_actions(self, pp_rank: int) -> tuple[Action, ...]:
        return self.actions[pp_rank]

    def count(self, pp_rank: int, *kinds: ActionKind) -> int:
        return sum(a.kind in kinds for a in self.actions[pp_rank])

    def __str__(self) -> str:
        head = (f"{self.kind.value}: pp={self.pp}, virtual stages={self.num_virtual}, "
                f"microbatches={self.n_microbatches}")
        rows = [f"pp{r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])


def check_sizes(kind: ScheduleKind, pp: int, num_virtual: int, n_microbatches: int) -> None:
    """``PipelineConfigError`` for sizes ``kind`` cannot run, naming them and what to change."""
    for name, value in (("pp", pp), ("number of virtual stages", num_virtual), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PipelineConfigError(f"{name} must be a positive int, got {value!r}")
    if num_virtual % pp:
        raise PipelineConfigError(
            f"{num_virtual} virtual stages cannot be spread over pp={pp} ranks: each rank runs the same number "
            f"of model chunks, so the number of virtual stages must be a multiple of pp"
        )
    if kind.interleaved:
        if n_microbatches % pp:
            raise PipelineConfigError(
                f"the interleaved 1F1B schedule needs n_microbatches divisible by pp: got n_microbatches="
                f"{n_microbatches} and pp={pp}; change global_batch_size or local_batch_size so the accumulation "
                f"steps ({n_microbatches}) are a multiple of {pp}"
            )
    elif num_virtual != pp:
        raise PipelineConfigError(
            f"the {kind.value} schedule runs one stage per rank, got {num_virtual} virtual stages on pp={pp}; "
            f"use the interleaved 1F1B schedule for more than one model chunk per rank"
        )


def compute_order(kind: ScheduleKind, pp: int, num_virtual: int, n_microbatches: int) -> list[list[Action]]:
    """Each rank's compute actions, in the order it runs them."""
    check_sizes(kind, pp, num_virtual, n_microbatches)
    m = n_microbatches
    out: list[list[Action]] = []
    for r in range(pp):
        if kind is ScheduleKind.GPIPE:
            out.append([Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)])
        elif kind is ScheduleKind.ONE_F_ONE_B:
            out.append(_one_f_one_b(r, pp, m, B))
        elif kind is ScheduleKind.ZERO_BUBBLE:
            out.append(_zero_bubble(r, pp, m))
        else:
            out.append(_interleaved(r, pp, num_virtual // pp, m))
    return out


def _one_f_one_b(r: int, pp: int, m: int, backward: ActionKind) -> list[Action]:
    """Warm up with ``pp - r - 1`` forwards, then alternate one forward and one backward, then
    drain the backwards: at most ``pp - r`` microbatches are in flight on rank ``r``."""
    warmup = min(pp - r - 1, m)
    acts = [Action(F, r, i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [Action(F, r, warmup + i), Action(backward, r, i)]
    acts += [Action(backward, r, i) for i in range(m - warmup, m)]
    return acts


def _zero_bubble(r: int, pp: int, m: int) -> list[Action]:
    """ZB-H1: the 1F1B order with each backward computing only the input gradient (I); weight
    gradients (W) wait in a queue, rank ``r`` keeping up to ``pp - 1 - r`` of them back to fill the
    idle time at the end of the step, where the first ranks wait the longest."""
    acts: list[Action] = []
    pending: deque[Action] = deque()
    lag = pp - 1 - r
    for a in _one_f_one_b(r, pp, m, I):
        acts.append(a)
        if a.kind is I:
            pending.append(Action(W, r, a.microbatch))
            while len(pending) > lag:
                acts.append(pending.popleft())
    # cooldown: one W after each remaining I is already handled above; flush the rest at the end
    acts.extend(pending)
    return acts


def _interleaved(r: int, pp: int, chunks: int, m: int) -> list[Action]:
    """The interleaved 1F1B order: forwards go through the chunks in groups of ``pp`` microbatches
    (chunk 0 for microbatches 0..pp-1, chunk 1 for the same, ..., then the next group); backwards
    through the chunks in reverse.  Rank ``r`` warms up with ``(pp - r - 1) * 2 + (chunks - 1) * pp``
    forwards (all of them when ``m == pp``), then alternates, then drains."""
    total = m * chunks

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * chunks)
        chunk = within // pp
        if not forward:
            chunk = chunks - 1 - chunk
        return chunk * pp + r, group * pp + within % pp

    if m == pp:
        warmup = total
    else:
        warmup = min((pp - r - 1) * 2 + (chunks - 1) * pp, total)
    acts: list[Action] = []
    for k in range(warmup):
        v, mb = unit(k, True)
        acts.append(Action(F, v, mb))
    for k in range(total - warmup):
        v, mb = unit(warmup + k, True)
        acts.append(Action(F, v, mb))
        v, mb = unit(k, False)
        acts.append(Action(B, v, mb))
    for k in range(total - warmup, total):
        v, mb = unit(k, False)
        acts.append(Action(B, v, mb))
    return acts


def with_communication(order: Sequence[Sequence[Action]], pp: int, num_virtual: int) -> list[list[Action]]:
    """``order`` with a RECV before each compute that consumes another rank's data and a SEND after
    each compute that produces data for another rank (stages on the same rank hand over in memory)."""
    out: list[list[Action]] = []
    for r, acts in enumerate(order):
        row: list[Action] = []
        for a in acts:
            v, mb = a.stage, a.microbatch
            prev_rank = stage_rank(v - 1, pp) if v > 0 else None
            next_rank = stage_rank(v + 1, pp) if v < num_virtual - 1 else None
            if a.kind is F:
                if prev_rank is not None and prev_rank != r:
                    row.append(Action(ActionKind.RECV_F, v, mb, prev_rank))
                row.append(a)
                if next_rank is not None and next_rank != r:
                    row.append(Action(ActionKind.SEND_F, v, mb, next_rank))
            elif a.kind in (B, I):
                if next_rank is not None and next_rank != r:
                    row.append(Action(ActionKind.RECV_B, v, mb, next_rank))
                row.append(a)
                if prev_rank is not None and prev_rank != r:
                    row.append(Action(ActionKind.SEND_B, v, mb, prev_rank))
            else:
                row.append(a)
        out.append(row)
    return out


def build_plan(kind: ScheduleKind, pp: int, n_microbatches: int, num_virtual: int | None = None) -> PipelinePlan:
    """The plan of ``kind`` for ``pp`` ranks, ``num_virtual`` virtual stages (default ``pp``) and
    ``n_microbatches`` microbatches; ``PipelineConfigError`` for sizes it cannot run."""
    nv = pp if num_virtual is None else num_virtual
    order = compute_order(kind, pp, nv, n_microbatches)
    rows = with_communication(order, pp, nv)
    return PipelinePlan(kind, pp, nv, n_microbatches, tuple(tuple(r) for r in rows))


@dataclass
class Simulation:
    """What ``simulate`` found: the time every rank finished, its idle time, and the most
    microbatch activations each virtual stage held at once."""

    makespan: int
    busy: list[int]
    peak_activations: dict[int, int] = field(default_factory=dict)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time until the last one finishes."""
        total = self.makespan * len(self.busy)
        return (total - sum(self.busy)) / total if total else 0.0


def simulate(plan: PipelinePlan, cost: dict[ActionKind, int] | None = None) -> Simulation:
    """Run ``plan`` on a model of the ranks: a compute takes ``cost[kind]`` time units (F 1, B 2,
    I 1, W 1 by default), a SEND is free and never blocks, a RECV waits for its SEND.  Raises
    ``PipelineConfigError`` when the plan deadlocks, a receive has no send, or a compute runs
    before the data it needs; returns the makespan, busy times and peak stored activations (an
    activation is held from F until the B, or W, that frees it)."""
    cost = cost or {F: 1, B: 2, I: 1, W: 1}
    pp = plan.pp
    pos = [0] * pp
    clock = [0] * pp
    busy = [0] * pp
    sent: dict[tuple[ActionKind, int, int], int] = {}  # (kind, stage, mb) -> time available
    done: set[tuple[ActionKind, int, int]] = set()
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    while True:
        progressed = False
        for r in range(pp):
            acts = plan.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind.is_recv:
                    src_kind = ActionKind.SEND_F if a.kind is ActionKind.RECV_F else ActionKind.SEND_B
                    src_stage = a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage + 1
                    key = (src_kind, src_stage, a.microbatch)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                elif a.kind.is_send:
                    sent[(a.kind, a.stage, a.microbatch)] = clock[r]
                else:
                    _check_ready(plan, r, a, done)
                    clock[r] += cost[a.kind]
                    busy[r] += cost[a.kind]
                    if a.kind is F:
                        held[a.stage] = held.get(a.stage, 0) + 1
                        peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
                    elif a.kind in (B, W):
                        held[a.stage] -= 1
                    # handovers on the same rank are available at once
                done.add((a.kind, a.stage, a.microbatch))
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(plan.actions[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = {r: str(plan.actions[r][pos[r]]) for r in range(pp) if pos[r] < len(plan.actions[r])}
            raise PipelineConfigError(f"the {plan.kind.value} plan deadlocks: ranks wait at {stuck}")
    return Simulation(makespan=max(clock), busy=busy, peak_activations=peak)


def _check_ready(plan: PipelinePlan, r: int, a: Action, done: set[tuple[ActionKind, int, int]]) -> None:
    v, mb, last = a.stage, a.microbatch, plan.num_virtual - 1
    needs: list[tuple[ActionKind, int, int]] = []
    if a.kind is F and v > 0:
        needs.append((F, v - 1, mb))
    if a.kind in (B, I):
        needs.append((F, v, mb))
        if v < last:
            needs.append((B, v + 1, mb) if (B, v + 1, mb) in done else (I, v + 1, mb))
    if a.kind is W:
        needs.append((I, v, mb))
    missing = [n for n in needs if n not in done]
    if missing:
        raise PipelineConfigError(
            f"the {plan.kind.value} plan runs {a} on pp{r} before {[f'{k.value}{m}@v{s}' for k, s, m in missing]}"
        )


def theoretical_bubble(kind: ScheduleKind, pp: int, n_microbatches: int, chunks: int = 1) -> float:
    """The textbook idle fraction with backward = 2 x forward: ``(pp - 1) / (m * chunks + pp - 1)``
    for 1F1B, GPipe and interleaved 1F1B (with ``chunks`` model chunks per rank; ``m`` microbatches);
    the measured one (``simulate``) can be larger where a schedule waits on P2P ordering."""
    return (pp - 1) / (n_microbatches * chunks + pp - 1)
