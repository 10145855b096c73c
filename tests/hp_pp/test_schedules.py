"""The pure schedule plans (no ranks): deadlock-free, every compute once, exact P2P counts by
formula, peak stored activations (1F1B <= pp, GPipe = every microbatch), printable."""

from __future__ import annotations

import itertools

import pytest

from hp_pp import (
    ActionKind,
    PipelineConfigError,
    PipelinePlan,
    ScheduleKind,
    build_plan,
    simulate,
    theoretical_bubble,
)

K = ActionKind
SIZES = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]
INTERLEAVED = [(pp, c, m) for pp in (2, 3, 4) for c in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp, 5 * pp)]


def _expected_p2p(pp: int, nv: int, m: int, r: int) -> tuple[int, int]:
    """Sends and receives of pp rank r per step: for each of its stages, one activation out per
    microbatch unless it is the last stage, one gradient out unless it is the first; a neighbour
    on the same rank (pp = 1) hands over in memory.  Receives mirror the sends."""
    if pp == 1:
        return 0, 0
    stages = [v for v in range(nv) if v % pp == r]
    sends = m * sum((v < nv - 1) + (v > 0) for v in stages)
    return sends, sends


def _check(plan: PipelinePlan, nv: int, m: int) -> None:
    sim = simulate(plan)  # raises on deadlock or on a compute before its data
    for r in range(plan.pp):
        stages = [v for v in range(nv) if v % plan.pp == r]
        want_s, want_r = _expected_p2p(plan.pp, nv, m, r)
        assert plan.count(r, K.SEND_F, K.SEND_B) == want_s
        assert plan.count(r, K.RECV_F, K.RECV_B) == want_r
        assert plan.count(r, K.F) == m * len(stages)
        fwd = sorted((a.stage, a.microbatch) for a in plan.actions[r] if a.kind is K.F)
        assert fwd == sorted(itertools.product(stages, range(m)))
    assert sim.bubble_fraction >= 0


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE])
def test_single_chunk_schedules(kind):
    for pp, m in SIZES:
        plan = build_plan(kind, pp, m)
        _check(plan, pp, m)
        sim = simulate(plan)
        for r in range(pp):
            peak = sim.peak_activations[r]
            if kind is ScheduleKind.GPIPE:
                assert peak == m
            elif kind is ScheduleKind.ONE_F_ONE_B:
                assert peak <= pp and peak == min(pp - r, m)
            else:  # deferred weight gradients keep at most pp - 1 - r more
                assert peak <= min(m, (pp - r) + (pp - 1 - r))
            if kind is ScheduleKind.ZERO_BUBBLE:
                assert plan.count(r, K.I) == plan.count(r, K.W) == m and plan.count(r, K.B) == 0
            else:
                assert plan.count(r, K.B) == m
    print(f"[schedules] {kind.value}: {len(SIZES)} (pp, microbatches) plans checked")


def test_interleaved():
    for pp, chunks, m in INTERLEAVED:
        nv = pp * chunks
        plan = build_plan(ScheduleKind.INTERLEAVED_1F1B, pp, m, nv)
        _check(plan, nv, m)
        sim = simulate(plan)
        for v in range(nv):
            assert sim.peak_activations[v] <= m
        # interleaving shrinks the bubble against plain 1F1B on the same ranks and microbatches
        if m > pp:
            assert sim.bubble_fraction <= simulate(build_plan(ScheduleKind.ONE_F_ONE_B, pp, m)).bubble_fraction
    print(f"[schedules] interleaved_1f1b: {len(INTERLEAVED)} (pp, chunks, microbatches) plans checked")


def test_one_f_one_b_bubble_is_textbook():
    for pp, m in SIZES:
        sim = simulate(build_plan(ScheduleKind.ONE_F_ONE_B, pp, m))
        assert abs(sim.bubble_fraction - theoretical_bubble(ScheduleKind.ONE_F_ONE_B, pp, m)) < 1e-9, (pp, m)


def test_plan_prints():
    text = str(build_plan(ScheduleKind.ONE_F_ONE_B, 2, 2))
    assert text.splitlines() == [
        "1f1b: pp=2, virtual stages=2, microbatches=2",
        "pp0: F0@v0 SEND_F0@v0->pp1 F1@v0 SEND_F1@v0->pp1 RECV_B0@v0<-pp1 B0@v0 RECV_B1@v0<-pp1 B1@v0",
        "pp1: RECV_F0@v1<-pp0 F0@v1 B0@v1 SEND_B0@v1->pp0 RECV_F1@v1<-pp0 F1@v1 B1@v1 SEND_B1@v1->pp0",
    ]


@pytest.mark.parametrize(
    "kind,pp,m,nv,match",
    [
        (ScheduleKind.INTERLEAVED_1F1B, 2, 3, 4, "n_microbatches divisible by pp"),
        (ScheduleKind.INTERLEAVED_1F1B, 4, 6, 8, "n_microbatches divisible by pp"),
        (ScheduleKind.ONE_F_ONE_B, 2, 4, 4, "one stage per rank"),
        (ScheduleKind.INTERLEAVED_1F1B, 2, 4, 5, "multiple of pp"),
        (ScheduleKind.GPIPE, 2, 0, 2, "n_microbatches must be a positive int"),
        (ScheduleKind.GPIPE, 0, 2, 2, "pp must be a positive int"),
    ],
)
def test_bad_sizes(kind, pp, m, nv, match):
    with pytest.raises(PipelineConfigError, match=match):
        build_plan(kind, pp, m, nv)
