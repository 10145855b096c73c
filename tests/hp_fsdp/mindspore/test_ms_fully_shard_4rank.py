# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,var-annotated,assignment,call-arg"
"""fully_shard on 4 MindSpore CPU ranks: FSDP over 4 (uneven: out.weight's 3 rows give the last
rank none), HSDP 2x2 (shard inside pairs, replicate across them) and TP + FSDP 2x2 each train 3 AdamW steps
equal to one process, with exact collective counts and each rank's share of parameter,
gradient and optimizer-state bytes; clip_grads under each equals one process.  The ranks start once for the module."""

from __future__ import annotations

from ms_fsdp_cases import GROUPS, check_clip, check_numbers, run_case

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})


def test_fsdp_4_ranks(pool) -> None:
    results = pool.run(run_case, {"mesh": (4,)})
    check_numbers(results)
    for r in results:
        assert r["comms"] == [{"all_gather": GROUPS, "reduce_scatter": GROUPS}] * 3, r["comms"]
    full = results[0]["full_bytes"]
    assert sum(r["param_bytes"] for r in results) == full
    # torch.chunk rows of every dim 0 (10 -> 3,3,3,1; 6 -> 2,2,2,0; 3 -> 1,1,1,0): 31%/31%/31%/6%.
    assert [r["param_bytes"] for r in results] == [704, 704, 704, 132], [r["param_bytes"] for r in results]
    assert all(r["grad_bytes"] == r["param_bytes"] and r["opt_bytes"] == 2 * r["param_bytes"] for r in results)
    print("fsdp4 bytes per rank (params, grads, adam state) of", full, ":",
          [(r["param_bytes"], r["grad_bytes"], r["opt_bytes"]) for r in results])


def test_hsdp_2x2(pool) -> None:
    """Gather and reduce_scatter inside each pair, one all_reduce across pairs per group."""
    results = pool.run(run_case, {"mesh": (2, 2)})
    check_numbers(results)
    for r in results:
        assert r["comms"] == [{"all_gather": GROUPS, "reduce_scatter": GROUPS, "all_reduce": GROUPS}] * 3, r["comms"]
    full = results[0]["full_bytes"]
    # Replicas hold the same half: ranks 0 and 2 (shard 0), ranks 1 and 3 (shard 1).
    assert results[0]["param_bytes"] + results[1]["param_bytes"] == full
    assert results[0]["param_bytes"] == results[2]["param_bytes"]
    print("hsdp2x2 param bytes per rank of", full, ":", [r["param_bytes"] for r in results])


def test_tp_then_fsdp_2x2(pool) -> None:
    """(dp=2, tp=2): TP inside each block (up colwise, down rowwise), fully_shard over dp on top.
    Every rank's TP-then-dp shards equal one process's rows; FSDP's own collectives are one
    all_gather and one reduce_scatter per group per step on the dp group."""
    results = pool.run(run_case, {"mesh": (2, 2), "tp": True})
    for r in results:
        assert r["names_match"]
        assert r["worst"]["grad"] <= 1.0 and r["worst"]["param"] <= 1.0, r["worst"]
    ours = [(results[0]["losses"][k] + results[2]["losses"][k]) / 2 for k in range(3)]
    for a, b in zip(ours, results[0]["ref_losses"]):
        assert abs(a - b) <= 1e-6 + 1.5e-4 * abs(b), (ours, results[0]["ref_losses"])
    for r in results:
        for c in r["comms"]:
            assert c["all_gather"] == GROUPS and c["reduce_scatter"] == GROUPS, r["comms"]
    print("tp+fsdp comms per step:", results[0]["comms"][0], "param bytes:", [r["param_bytes"] for r in results])


def test_clip_grads_fsdp_hsdp_tp(pool) -> None:
    """hp_fsdp.clip_grads on the sharded gradients: FSDP over 4 (the last rank holds no row of
    some tensors) with norms 2 and inf, HSDP 2x2 (reduced over the shard dim only) with inf, TP +
    FSDP 2x2 (reduced over dp and tp) with 2: each step's total norm equals one process's norm of
    the whole gradients and 3 clipped steps equal one process."""
    for cfg in ({"mesh": (4,), "clip": (0.1, 2.0)}, {"mesh": (4,), "clip": (0.02, float("inf"))},
                {"mesh": (2, 2), "clip": (0.02, float("inf"))}, {"mesh": (2, 2), "tp": True, "clip": (0.1, 2.0)}):
        check_clip(pool.run(run_case, cfg), cfg["clip"][0])
