# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""fully_shard on 2 gloo ranks against one process with the same weights: forward, backward and
3 AdamW steps, uneven parameter shapes, nested and root-only sharding, both reshard policies,
gradient accumulation, a sum reduction, bf16 mixed precision; exact collective counts per step
and the bytes each rank holds."""

from __future__ import annotations

import pytest
from fsdp_models import GROUPS, Case, check_numbers, run_case

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)


@pytest.mark.parametrize("reshard", [None, True, False])
def test_fsdp_2_ranks_matches_one_process(pool2: RankPool, reshard: bool | None) -> None:
    results = pool2.run(run_case, Case(reshard=reshard))
    check_numbers(results)
    for r in results:
        for comm in r["comms"]:
            # one all_gather per group before forward, one more before backward for each group
            # that resharded after forward (by default all but the root), one reduce_scatter per group
            gathers = {None: 2 * GROUPS - 1, True: 2 * GROUPS, False: GROUPS}[reshard]
            assert comm == {"all_gather@0": gathers, "reduce_scatter@0": GROUPS}, comm
        assert {tuple(v) for v in r["placements"].values()} == {("S(0)",)}


def test_root_only_is_one_group(pool2: RankPool) -> None:
    results = pool2.run(run_case, Case(nested=False))
    check_numbers(results)
    for r in results:
        assert all(c == {"all_gather@0": 1, "reduce_scatter@0": 1} for c in r["comms"]), r["comms"]


def test_accumulation_reduces_once_at_the_sync_step(pool2: RankPool) -> None:
    results = pool2.run(run_case, Case(micro=3))
    check_numbers(results)
    for r in results:
        for comm in r["comms"]:
            assert comm == {
                "all_gather@0": 2 * GROUPS - 1, "all_gather@1": 2 * GROUPS - 1, "all_gather@2": 2 * GROUPS - 1,
                "reduce_scatter@2": GROUPS,
            }, comm


def test_sum_reduction_with_divide_factor_1(pool2: RankPool) -> None:
    check_numbers(pool2.run(run_case, Case(divide_factor=1.0)))


def test_memory_is_the_exact_share(pool2: RankPool) -> None:
    results = pool2.run(run_case, Case(steps=1))
    full = results[0]["full_bytes"]
    for r in results:
        # parameters + gradients + AdamW's two moments: 4 copies of this rank's torch.chunk rows
        assert r["held"] == 4 * r["share_bytes"], (r["held"], r["share_bytes"])
    assert sum(r["held"] for r in results) == 4 * full, [r["held"] for r in results]
    print(f"bytes held per rank (params+grads+AdamW): {[r['held'] for r in results]}, "
          f"one-process total {4 * full}")
