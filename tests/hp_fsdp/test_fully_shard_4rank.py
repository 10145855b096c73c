# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""fully_shard on 4 gloo ranks against one process with the same weights: FSDP over 4 ranks (a
parameter with 3 rows leaves one rank an empty shard), HSDP on a 2x2 (replicate, shard) mesh, and
RFC row C15: tensor parallelism on mesh['tp'] first, then FSDP on mesh['dp'] of a 2x2 mesh, and HSDP
with TP on a (2, 1, 2) mesh."""

from __future__ import annotations

import pytest
from fsdp_models import GROUPS, Case, check_numbers, run_case

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)


def test_fsdp_4_ranks_matches_one_process(pool4: RankPool) -> None:
    results = pool4.run(run_case, Case())
    check_numbers(results)
    for r in results:
        for comm in r["comms"]:
            assert comm == {"all_gather@0": 2 * GROUPS - 1, "reduce_scatter@0": GROUPS}, comm
    full = results[0]["full_bytes"]
    assert sum(r["held"] for r in results) == 4 * full
    assert all(r["held"] == 4 * r["share_bytes"] for r in results), [(r["held"], r["share_bytes"]) for r in results]


@pytest.mark.parametrize("reshard", [None, False])
def test_hsdp_2x2_matches_one_process(pool4: RankPool, reshard: bool | None) -> None:
    results = pool4.run(run_case, Case(kind="hsdp", reshard=reshard))
    check_numbers(results)
    for r in results:
        for comm in r["comms"]:
            gathers = GROUPS + (GROUPS - 1 if reshard is None else 0)
            # HSDP: the reduce_scatter in the shard group is followed by one all_reduce across replicas
            assert comm == {"all_gather@0": gathers, "reduce_scatter@0": GROUPS, "all_reduce@0": GROUPS}, comm
        assert {tuple(v) for v in r["placements"].values()} == {("R", "S(0)")}
    full = results[0]["full_bytes"]
    # each shard group holds one full copy
    assert sum(r["held"] for r in results) == 2 * 4 * full
    assert all(r["held"] == 4 * r["share_bytes"] for r in results)


def test_C15_tp_then_fsdp_2x2_matches_one_process(pool4: RankPool) -> None:
    results = pool4.run(run_case, Case(kind="c15"))
    check_numbers(results)
    for r in results:
        pl, names = r["placements"], r["mesh_names"]
        # a TP weight keeps its TP placement and is sharded over dp on top of it
        assert pl["blocks.0.up.weight"] == ["S(0)", "S(0)"] and names["blocks.0.up.weight"] == ("tp", "dp")
        assert pl["blocks.0.down.weight"] == ["S(1)", "S(0)"]
        assert pl["blocks.0.down.bias"] == ["R", "S(0)"]
        assert pl["inp.weight"] == ["S(0)"] and names["inp.weight"] == ("dp",)
        for comm in r["comms"]:
            # FSDP's collectives are the same as without TP; TP adds its own all_reduces
            assert comm["all_gather@0"] == 2 * GROUPS - 1 and comm["reduce_scatter@0"] == GROUPS, comm


def test_C15_with_uneven_tp_shards(pool4: RankPool) -> None:
    """Hidden size 7 over tp=2: TP shards of 4 and 3 columns, each then split over dp=2."""
    check_numbers(pool4.run(run_case, Case(kind="c15", hidden=7)))


def test_hsdp_with_tp_on_a_3d_mesh(pool4: RankPool) -> None:
    """(dp_replicate, dp_shard, tp) = (2, 1, 2): TP weights get (tp placement, Replicate, Shard(0))
    on the ('tp', 'dp_replicate', 'dp_shard') dims; gradients are all-reduced across replicas."""
    results = pool4.run(run_case, Case(kind="hsdp_tp"))
    check_numbers(results)
    for r in results:
        assert r["placements"]["blocks.0.up.weight"] == ["S(0)", "R", "S(0)"]
        assert r["mesh_names"]["blocks.0.up.weight"] == ("tp", "dp_replicate", "dp_shard")
        assert r["placements"]["inp.weight"] == ["R", "S(0)"]
        for comm in r["comms"]:
            # a shard group of one rank needs no gather or reduce_scatter: only the replica all_reduce
            assert "all_gather@0" not in comm and "reduce_scatter@0" not in comm, comm
            assert comm["all_reduce@0"] >= GROUPS, comm
