# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,var-annotated,assignment,call-arg"
"""fully_shard on 2 MindSpore CPU ranks: nested FSDP (three blocks and the root) trains 3 AdamW
steps equal to one process, with one all_gather and one reduce_scatter per group per step; each
rank holds its half of parameters, gradients and optimizer state; gradient accumulation with sync
off equals one process; clip_grads on the sharded gradients equals one process; bad input fails on every rank.  The ranks start once for the module."""

from __future__ import annotations

from ms_fsdp_cases import GROUPS, check_clip, check_numbers, run_case

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})


def test_fsdp_matches_one_process_with_exact_collectives(pool) -> None:
    results = pool.run(run_case, {"mesh": (2,)})
    check_numbers(results)
    for r in results:
        # MindSpore: one all_gather per group per step (backward reuses the values the forward's
        # graph holds; torch gathers again for every group that resharded), one reduce_scatter per group.
        assert r["comms"] == [{"all_gather": GROUPS, "reduce_scatter": GROUPS}] * 3, r["comms"]
    # Each rank holds its rows: 2 ranks hold the whole model between them, neither holds it all.
    assert sum(r["param_bytes"] for r in results) == results[0]["full_bytes"]
    assert all(r["param_bytes"] < 0.6 * r["full_bytes"] for r in results), [r["param_bytes"] for r in results]
    assert all(r["grad_bytes"] == r["param_bytes"] and r["opt_bytes"] == 2 * r["param_bytes"] for r in results)


def test_gradient_accumulation_without_sync(pool) -> None:
    """Two micro-batches per step, sync off for the first: one reduce_scatter per group per step."""
    results = pool.run(run_case, {"mesh": (2,), "accum": 2})
    check_numbers(results)
    for r in results:
        assert r["comms"] == [{"all_gather": 2 * GROUPS, "reduce_scatter": GROUPS}] * 3, r["comms"]


def test_mixed_precision_float16(pool) -> None:
    """MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32): the all_gathers move half
    the bytes of float32, the sharded parameters stay float32 and the run tracks the float32 one
    process within float16's precision (MindSpore's CPU MatMul has no bfloat16 kernel)."""
    fp32 = pool.run(run_case, {"mesh": (2,), "steps": 1})
    half = pool.run(run_case, {"mesh": (2,), "steps": 1, "mp": "fp16", "tol": (2e-2, 2e-3)})
    for a, b in zip(fp32, half):
        assert b["dtypes"] == ["Float32"], b["dtypes"]
        assert b["comm_bytes"][0]["all_gather"] * 2 == a["comm_bytes"][0]["all_gather"], (a["comm_bytes"], b["comm_bytes"])
        assert b["comm_bytes"][0]["reduce_scatter"] == a["comm_bytes"][0]["reduce_scatter"]
        assert b["worst"]["grad"] <= 1.0, b["worst"]
    assert abs(sum(r["losses"][0] for r in half) / 2 - half[0]["ref_losses"][0]) <= 2e-3 * half[0]["ref_losses"][0]


def test_clip_grads_matches_one_process(pool) -> None:
    """hp_fsdp.clip_grads on the sharded gradients value_and_grad returns: the total norm (2 and
    inf) equals one process's norm of the whole gradients, and 3 clipped steps equal one process."""
    for clip in ((0.1, 2.0), (0.02, float("inf"))):
        check_clip(pool.run(run_case, {"mesh": (2,), "clip": clip}), clip[0])


def _bad_inputs(rank: int, world: int) -> list[str]:
    from ms_fsdp_cases import build

    from hp_dtensor import init_device_mesh
    from hp_fsdp import clip_grad_norm_, clip_grads, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    errors = []
    net = build(blocks=1)
    for call in (
        lambda: fully_shard(net, mesh=mesh, reshard_after_forward=3),
        lambda: fully_shard(net, mesh="dp"),
        lambda: clip_grad_norm_(net.trainable_params(), 1.0),
        lambda: clip_grads(tuple(net.trainable_params())[:2], 1.0, parameters=net.trainable_params()),
        lambda: clip_grads(tuple(net.trainable_params())[:1], -1.0),
    ):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_bad_input_fails_on_every_rank(pool) -> None:
    results = pool.run(_bad_inputs)
    assert results[0] == results[1], results
    rc, mesh, clip, count, neg = results[0]
    assert rc.startswith("ValueError: reshard_after_forward=3"), rc
    assert mesh.startswith("TypeError: fully_shard: mesh must be a DeviceMesh"), mesh
    # MindSpore parameters hold no .grad: the in-place form names the one to use
    assert clip.startswith("NotImplementedError: clip_grad_norm_ / clip_grads_with_norm_ read .grad"), clip
    assert "hp_fsdp.clip_grads" in clip, clip
    assert count.startswith("ValueError: clip_grads: 2 gradients but"), count
    assert neg.startswith("ValueError: max_norm must be >= 0, got -1.0"), neg
