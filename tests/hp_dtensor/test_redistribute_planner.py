# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The pure planner: cheapest plans, validity on N-D meshes, and purity (no framework import)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dtensor.layout.shard_geometry import check_even_sharding, local_offset, local_shape
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.redistribute.planner import (
    BYTES_ONLY,
    GLOO_CPU_LATENCY_BYTES,
    CostModel,
    RedistributePlan,
    StepKind,
    cost_model,
    plan_distribute,
    plan_redistribute,
    set_cost_model,
    step_cost,
)

R, P = Replicate(), Partial()


def kinds(mesh, shape, src, dst) -> list[str]:
    return [s.kind for s in plan_redistribute(mesh, shape, src, dst).steps]


@pytest.mark.parametrize(
    "src,dst,expected",
    [
        ((Shard(0),), (R,), ["all_gather"]),
        ((P,), (R,), ["all_reduce"]),
        ((P,), (Shard(1),), ["reduce_scatter"]),
        ((Shard(0),), (Shard(1),), ["all_to_all"]),
        ((R,), (Shard(1),), ["chunk"]),
        ((R,), (P,), ["to_partial"]),
        ((Shard(0),), (P,), ["all_gather", "to_partial"]),
        ((R,), (R,), []),
    ],
)
def test_one_dim_plans(src, dst, expected) -> None:
    assert kinds((4,), (8, 8), src, dst) == expected


def test_partial_is_reduced_on_the_small_shard_first() -> None:
    plan = plan_redistribute((2, 2), (8, 8), (P, Shard(0)), (R, R))
    assert [(s.kind, s.mesh_dim) for s in plan.steps] == [("all_reduce", 0), ("all_gather", 1)]
    # local block is 4x8=32: all_reduce moves 2*(1/2)*32, then all_gather moves (2-1)*32
    assert plan.cost == pytest.approx(2 * 0.5 * 32 + 32)


def test_partial_to_shard_prefers_reduce_scatter_over_all_reduce() -> None:
    plan = plan_redistribute((4,), (16, 4), (P,), (Shard(0),))
    assert [s.kind for s in plan.steps] == ["reduce_scatter"]


def test_nested_shards_gather_inner_mesh_dim_first() -> None:
    steps = plan_redistribute((2, 2), (8, 4), (Shard(0), Shard(0)), (R, R)).steps
    assert [s.mesh_dim for s in steps] == [1, 0]


def test_uneven_target_is_planned_with_padded_cost() -> None:
    # 6 rows over 4 ranks: chunks 2,2,2,0; gathering moves 3 padded pieces of 2x4 per rank
    assert kinds((4,), (6, 4), (R,), (Shard(0),)) == ["chunk"]
    plan = plan_redistribute((4,), (6, 4), (Shard(0),), (R,))
    assert [s.kind for s in plan.steps] == ["all_gather"] and plan.cost == pytest.approx(3 * 8)
    # 5 rows reduce-scattered over 4: the input is padded to 8 rows, 3/4 of it moves
    plan = plan_redistribute((4,), (5, 1), (P,), (Shard(0),))
    assert [s.kind for s in plan.steps] == ["reduce_scatter"] and plan.cost == pytest.approx(0.75 * 8)
    # with an even dim to scatter on, reduce-scattering there and moving the small shard moves
    # fewer bytes; on a tensor this small one collective's latency outweighs them
    plan = plan_redistribute((4,), (5, 4), (P,), (Shard(0),), model=BYTES_ONLY)
    assert [s.kind for s in plan.steps] == ["reduce_scatter", "all_to_all"] and plan.cost < 0.75 * 32
    assert kinds((4,), (5, 4), (P,), (Shard(0),)) == ["reduce_scatter"]


def test_intermediate_states_may_be_uneven_on_2x2() -> None:
    # (6,) on [S0, S0] splits 6 -> 3 -> 2/1: uneven inside, even overall; used to raise
    plan = plan_redistribute((2, 2), (6,), (R, R), (Shard(0), Shard(0)))
    assert [s.kind for s in plan.steps] == ["chunk", "chunk"]
    plan_redistribute((2, 2), (6, 2), (Shard(0), Shard(0)), (Shard(1), Shard(0)))


def test_mixed_partials_are_refused_except_sum_with_avg() -> None:
    with pytest.raises(ValueError, match=r"mix Partial reduce ops \['max', 'sum'\]"):
        plan_redistribute((2, 2), (4,), (Partial("sum"), Partial("max")), (R, R))
    with pytest.raises(ValueError, match="mix Partial"):
        plan_redistribute((2, 2), (4,), (R, R), (Partial("min"), Partial("avg")))
    plan_redistribute((2, 2), (4,), (Partial("sum"), Partial("avg")), (R, R))
    # a plan between one-op states never passes through a mixed state
    plan = plan_redistribute((2, 2), (4,), (Partial("sum"), Partial("sum")), (Partial("max"), Partial("max")))
    state: list[Placement] = [Partial("sum"), Partial("sum")]
    for step in plan.steps:
        state[step.mesh_dim] = step.dst
        assert len({p.reduce_op for p in state if isinstance(p, Partial)}) <= 1


def test_plans_are_cached() -> None:
    a = plan_redistribute((2, 2), (4, 4), (Shard(0), R), (R, Shard(1)))
    b = plan_redistribute((2, 2), (4, 4), (Shard(0), R), (R, Shard(1)))
    assert a is b


placement_st = st.sampled_from([R, P, Shard(0), Shard(1), Shard(2)])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    mesh=st.sampled_from([(2,), (4,), (2, 2), (2, 2, 2)]),
    data=st.data(),
)
def test_any_pair_has_a_plan_ending_at_target(mesh, data) -> None:
    shape = (8, 8, 8)
    src = tuple(data.draw(placement_st) for _ in mesh)
    dst = tuple(data.draw(placement_st) for _ in mesh)
    plan = plan_redistribute(mesh, shape, src, dst)
    state = list(src)
    for step in plan.steps:
        assert state[step.mesh_dim] == step.src
        state[step.mesh_dim] = step.dst
        check_even_sharding(shape, mesh, state)
    assert tuple(state) == dst
    # never worse under either model than the naive plan "everything Replicate, then the target"
    for model in (BYTES_ONLY, CostModel()):
        best = plan_redistribute(mesh, shape, src, dst, model=model)
        to_r = plan_redistribute(mesh, shape, src, tuple(R for _ in mesh), model=model)
        from_r = plan_redistribute(mesh, shape, tuple(R for _ in mesh), dst, model=model)
        naive = modelled(to_r, model) + modelled(from_r, model)
        assert modelled(best, model) <= naive + 1e-9


def modelled(plan: RedistributePlan, model: CostModel, itemsize: int = 4) -> float:
    """What the planner minimises, in elements: bytes moved plus each collective's latency."""
    return plan.cost + len(plan.collectives()) * model.latency_bytes / itemsize


# [Partial, Replicate] -> [Shard(0), Shard(0)] on 2x2: torch reduce-scatters on mesh dim 0 and
# chunks on mesh dim 1 (1/2 of the tensor moves); chunking dim 1 first, reduce-scattering the half
# and all_to_all-ing it moves 3/8 in two collectives.  The latency term decides which.
PR, SS = (P, R), (Shard(0), Shard(0))


def test_latency_keeps_small_moves_in_one_collective() -> None:
    latency = GLOO_CPU_LATENCY_BYTES / 4  # in float32 elements
    # the bytes saved by the extra all_to_all are numel/8: it pays above 8x the latency
    crossover = 8 * latency
    for numel, expected in ((1024, ["reduce_scatter"]), (int(crossover * 0.9), ["reduce_scatter"]),
                            (int(crossover * 1.1), ["reduce_scatter", "all_to_all"])):
        shape = (numel // 8, 8)
        plan = plan_redistribute((2, 2), shape, PR, SS)
        assert plan.collectives() == expected, (numel, plan.steps)
        assert plan.collectives() == plan_redistribute((2, 2), shape, PR, SS, model=CostModel()).collectives()
    # the bytes-only model takes the three-step plan at any size
    assert plan_redistribute((2, 2), (128, 8), PR, SS, model=BYTES_ONLY).collectives() == [
        "reduce_scatter", "all_to_all"]


def test_latency_is_priced_per_byte_so_itemsize_moves_the_crossover() -> None:
    numel = int(8 * GLOO_CPU_LATENCY_BYTES / 4 * 1.5)  # past the float32 crossover, before bf16's
    shape = (numel // 8, 8)
    assert plan_redistribute((2, 2), shape, PR, SS, itemsize=4).collectives() == ["reduce_scatter", "all_to_all"]
    assert plan_redistribute((2, 2), shape, PR, SS, itemsize=2).collectives() == ["reduce_scatter"]
    with pytest.raises(ValueError, match="itemsize must be a positive number of bytes, got 0"):
        plan_redistribute((2, 2), shape, PR, SS, itemsize=0)


def test_set_cost_model_replans_and_validates() -> None:
    shape = (128, 8)
    before = cost_model()
    try:
        cached = plan_redistribute((2, 2), shape, PR, SS)
        set_cost_model(BYTES_ONLY)
        assert cost_model() is BYTES_ONLY
        assert plan_redistribute((2, 2), shape, PR, SS).collectives() == ["reduce_scatter", "all_to_all"]
    finally:
        set_cost_model(before)
    assert plan_redistribute((2, 2), shape, PR, SS).collectives() == cached.collectives() == ["reduce_scatter"]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="latency_bytes must be a finite number >= 0"):
            CostModel(bad)
    with pytest.raises(TypeError, match="set_cost_model takes a CostModel, got float"):
        set_cost_model(0.0)  # type: ignore[arg-type]


RS, AR, AG, A2A = StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE, StepKind.ALL_GATHER, StepKind.ALL_TO_ALL
FEWEST = CostModel(1e12)  # any saving in bytes is worth less than one collective

# (mesh, shape, src, dst, collectives of the byte-cheapest plan, of the plan with fewest collectives)
HAND_CASES = [
    ((2, 2), (64, 8), PR, SS, [RS, A2A], [RS]),  # torch: reduce_scatter, then a local chunk
    ((2, 2), (64, 8), (P, P), (R, R), [RS, AR, AG], [AR, AR]),
    ((2, 4), (64, 8), (R, Shard(0)), SS, [A2A, A2A], [AG]),
    ((2, 2), (64, 8), SS, (R, Shard(0)), [A2A, AG, A2A], [AG, AG]),
]


@pytest.mark.parametrize(("mesh", "shape", "src", "dst", "cheap", "few"), HAND_CASES)
def test_more_collectives_only_when_the_bytes_saved_exceed_their_latency(mesh, shape, src, dst, cheap, few) -> None:
    by_bytes = plan_redistribute(mesh, shape, src, dst, model=BYTES_ONLY)
    by_calls = plan_redistribute(mesh, shape, src, dst, model=FEWEST)
    assert by_bytes.collectives() == cheap and by_calls.collectives() == few
    assert by_bytes.cost < by_calls.cost
    # the latency at which both plans cost the same: the float32 bytes saved per extra collective
    tie = (by_calls.cost - by_bytes.cost) * 4 / (len(cheap) - len(few))
    assert plan_redistribute(mesh, shape, src, dst, model=CostModel(tie * 0.5)).steps == by_bytes.steps
    assert plan_redistribute(mesh, shape, src, dst, model=CostModel(tie * 2)).steps == by_calls.steps
    # under the default (gloo) latency: this small tensor takes the fewest collectives; scaled up
    # until the saving is twice the latency, the byte-cheapest plan
    assert tie < GLOO_CPU_LATENCY_BYTES
    assert plan_redistribute(mesh, shape, src, dst).steps == by_calls.steps
    big = (shape[0] * math.ceil(2 * GLOO_CPU_LATENCY_BYTES / tie),) + shape[1:]
    assert plan_redistribute(mesh, big, src, dst).collectives() == cheap


def test_equal_bytes_take_the_fewest_collectives() -> None:
    # 3 rows over 2x2: gathering mesh dim 1 and chunking twice moves as many (padded) elements as
    # two all_to_alls around the chunk; with any latency at all the one collective wins
    mesh, shape, src, dst = (2, 2), (3, 3), (R, Shard(0)), SS
    by_bytes = plan_redistribute(mesh, shape, src, dst, model=BYTES_ONLY)
    one = plan_redistribute(mesh, shape, src, dst, model=CostModel(1.0))
    assert one.cost == by_bytes.cost == 6
    assert one.collectives() == [AG] and len(by_bytes.collectives()) == 2


@pytest.mark.parametrize("shape", [(8, 64, 512), (8, 64, 2048)])
def test_a_collective_the_walker_skips_pays_no_latency(shape) -> None:
    # a mesh dim of one rank moves nothing and issues nothing, so the move on (2, 1, 2) issues
    # what the same move on (2, 2) does: the large tensor reduce-scatters, all_to_alls the half
    # and gathers it (parking the middle dim's shard costs nothing) rather than all-reducing it
    plan = plan_redistribute((2, 1, 2), shape, (P, Shard(0), Shard(1)), (R, Shard(0), Shard(2)))
    issued = [s.kind for s in plan.steps if s.kind.is_collective and s.mesh_dim != 1]
    assert issued == plan_redistribute((2, 2), shape, (P, Shard(1)), (R, Shard(2))).collectives()
    assert issued == ([A2A, AR] if shape[2] == 512 else [RS, A2A, AG])


def test_local_geometry_tiles_the_tensor() -> None:
    mesh, shape = (2, 2), (8, 4)
    pl: tuple[Placement, ...] = (Shard(0), Shard(0))
    seen = set()
    for coord in itertools.product(range(2), range(2)):
        off = local_offset(shape, mesh, pl, coord)
        ls = local_shape(shape, mesh, pl)
        seen.add(off)
        assert ls == (2, 4)
    assert sorted(seen) == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert math.prod(local_shape(shape, mesh, pl)) * 4 == 32


def test_pure_modules_import_without_a_framework() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'mindspore'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hp_dtensor, hp_dtensor.placement_types, hp_dtensor.layout.mesh_layout, hp_dtensor.layout.shard_geometry\n"
        "import hp_dtensor.redistribute.planner, hp_dtensor.comm_debug, hp_dtensor.layout.dtensor_spec, hp_dtensor.redistribute.executor\n"
        "import hp_dtensor.api.rng_tracker\n"
        "import hp_dtensor.sharding.pointwise, hp_dtensor.sharding.matrix, hp_dtensor.sharding.views\n"
        "import hp_dtensor.sharding.reductions, hp_dtensor.sharding.norms, hp_dtensor.sharding.embedding\n"
        "import hp_dtensor.sharding.attention, hp_dtensor.sharding.loss\n"
        "assert 'torch' not in sys.modules\n"
        "print('pure-ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=None)
    assert "pure-ok" in out.stdout, out.stderr


def test_plans_between_even_layouts_never_pass_an_uneven_state() -> None:
    # so backends with even-only collectives (MindSpore) keep working, and no padding is paid
    from hp_dtensor.layout.shard_geometry import is_even

    opts = [R, P, Shard(0), Shard(1)]
    checked = 0
    for mesh in ((2, 2), (2, 4)):
        for shape in itertools.product((2, 4, 6, 12), (2, 3, 6)):
            for src in itertools.product(opts, repeat=2):
                for dst in itertools.product(opts, repeat=2):
                    if not (is_even(shape, mesh, src) and is_even(shape, mesh, dst)):
                        continue
                    state = list(src)
                    for step in plan_redistribute(mesh, shape, src, dst).steps:
                        state[step.mesh_dim] = step.dst
                        assert is_even(shape, mesh, state), (mesh, shape, src, dst)
                    checked += 1
    assert checked > 2000


def test_step_kinds_are_an_enum_named_like_the_collectives() -> None:
    plan = plan_redistribute((2, 2), (8, 8), (Partial(), Shard(0)), (Replicate(), Replicate()))
    assert all(isinstance(s.kind, StepKind) for s in plan.steps)
    assert sorted(plan.collectives()) == ["all_gather", "all_reduce"]
    assert step_cost(StepKind.ALL_GATHER, 4, 10) == 30 and step_cost(StepKind.CHUNK, 4, 10) == 0.0


@pytest.mark.parametrize(
    ("placements", "source", "kinds"),
    [
        ((Shard(0),), None, ["chunk"]),
        ((Shard(0),), 0, ["scatter"]),
        ((Replicate(),), None, []),
        ((Replicate(),), 0, ["broadcast"]),
        ((Partial(),), 0, ["broadcast", "to_partial"]),
        # scatters first, then broadcasts on the smaller pieces, then the partial roots
        ((Partial(), Shard(1)), 0, ["scatter", "broadcast", "to_partial"]),
        ((Shard(0), Shard(0)), 1, ["scatter", "scatter"]),
    ],
)
def test_distribute_is_the_plan_from_replicate(placements, source, kinds) -> None:
    mesh = tuple(2 for _ in placements)
    plan = plan_distribute(mesh, (5, 6), placements, source)
    assert [str(s.kind) for s in plan.steps] == kinds
    assert plan.src == tuple(Replicate() for _ in placements) and plan.source == source
    if source is None:
        assert plan == plan_redistribute(mesh, (5, 6), plan.src, placements)
