# mypy: disable-error-code="no-untyped-def"
"""Ring (colossal) attention on 4 gloo ranks (CP groups of 2 and 4) against plain SDPA on the
whole sequence in one process: outputs and input gradients, fp64 and fp32, causal and EOD masks,
odd head counts and GQA over seeded generated cases; exactly cp - 1 key/value exchanges forward
and cp - 1 plus cp gradient hops backward; no dense mask; the documented error on every rank for
bad input."""

from __future__ import annotations

import pytest
from cp_cases import (
    generate_cases,
    run_attention_case,
    run_attention_case_unfused,
    run_bad_input,
    run_largest_tensor,
    run_reduce_loss_uneven,
    run_ring_beside_p2p,
)

from hp_cp import COMPRESSION_REQUIRED, CPMethod
from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=180)

TOL = {"float64": 1e-10, "float32": 2e-5}


def _check(results, case) -> dict[str, float]:
    worst: dict[str, float] = {}
    for r in results:
        for name, err in r["errs"].items():
            assert err < TOL[case.dtype], (case, name, err)
            worst[name] = max(worst.get(name, 0.0), err)
    return worst


def test_ring_matches_sdpa_on_the_whole_sequence(pool4: RankPool) -> None:
    cases = generate_cases(40, seed=2701, methods=(CPMethod.COLOSSAL,), world=4)
    worst = {"float64": 0.0, "float32": 0.0}
    for case in cases:
        results = pool4.run(run_attention_case, case)
        errs = _check(results, case)
        worst[case.dtype] = max(worst[case.dtype], *errs.values())
        for r in results:
            # the ring: cp - 1 key/value exchanges forward; backward the same plus the gradient
            # buffer's cp hops (the last one brings it home)
            assert r["fwd"] == {"send_recv": case.cp - 1}, (case, r["fwd"])
            assert r["bwd"] == {"send_recv": 2 * case.cp - 1}, (case, r["bwd"])
            kv_bytes = 2 * case.batch * case.kv_heads * case.seq // case.cp * case.head_dim * (
                8 if case.dtype == "float64" else 4)
            assert all(nbytes == kv_bytes for _, nbytes, _ in r["fwd_log"]), (case, r["fwd_log"])
    n_eod = sum(c.eod for c in cases)
    n_gqa = sum(c.kv_heads < c.heads for c in cases)
    print(f"ring attention: {len(cases)} generated cases ({n_eod} EOD, {n_gqa} GQA, "
          f"{sum(c.cp == 4 for c in cases)} at cp=4); worst relative error {worst}")


def test_ring_without_the_fused_kernel_matches_sdpa(pool4: RankPool) -> None:
    cases = generate_cases(10, seed=2709, methods=(CPMethod.COLOSSAL,), world=4)
    worst = 0.0
    for case in cases:
        worst = max(worst, *_check(pool4.run(run_attention_case_unfused, case), case).values())
    print(f"ring attention, blocks as explicit matmuls: {len(cases)} generated cases "
          f"({sum(c.eod for c in cases)} EOD, {sum(c.kv_heads < c.heads for c in cases)} GQA); "
          f"worst relative error {worst:.1e}")


def test_no_dense_mask_is_built(pool4: RankPool) -> None:
    seq = 96
    for r in pool4.run(run_largest_tensor, seq):
        # blocks are (S / 2cp) x (S / 2cp): the largest tensor is a rank's q/k/v, the largest mask a block's
        block = (seq // 8) ** 2
        assert r["mask"] <= block, r
        assert r["numel"] < seq * seq // 4, r
    print(f"largest tensor during ring attention at seq {seq}, cp 4: {r['numel']} elements, largest mask "
          f"{r['mask']} (a dense mask: {seq * seq})")


@pytest.mark.parametrize("what,kind,words", [
    ("seq_len", "ValueError", ["sequence length 26", "multiple of 8"]),
    ("ulysses_heads", "ValueError", ["num_attention_heads 5", "not divisible by 4"]),
    ("hybrid_degree", "ValueError", ["ulysses_degree_in_cp 3", "context_parallel 4"]),
    ("no_compression", "ValueError", [COMPRESSION_REQUIRED]),
    ("mask_full", "NotImplementedError", ["'full'", "causal"]),
    ("method_name", "ValueError", ["'stripes'", "colossal"]),
])
def test_bad_input_raises_the_same_error_on_every_rank(pool4: RankPool, what: str, kind: str,
                                                       words: list[str]) -> None:
    results = pool4.run(run_bad_input, what)
    assert len(set(results)) == 1, results
    got_kind, message = results[0]
    assert got_kind == kind, results[0]
    for w in words:
        assert w in message, (w, message)


def test_ring_runs_on_its_own_group_beside_other_p2p(pool4: RankPool) -> None:
    for seed in range(3):
        for r in pool4.run(run_ring_beside_p2p, seed):
            assert r["inbox"] == r["expected"], r
            assert max(r["errs"].values()) < 1e-12, r
    print(f"ring beside a pending default-group message with its tag: 3 cases, worst error {max(r['errs'].values()):.1e}")


def test_reduce_loss_with_uneven_token_counts(pool4: RankPool) -> None:
    counts = []
    for cp_degree, seed in [(2, 1), (4, 2), (4, 3), (2, 4)]:
        results = pool4.run(run_reduce_loss_uneven, cp_degree, seed)
        for r in results:
            assert r["err"] < 1e-14 and r["grad_err"] < 1e-15, r
        counts.append([r["count"] for r in results])
    assert all(0 in c and len(set(c)) > 1 for c in counts), counts
    print(f"reduce_loss: 4 cases, counted tokens per rank {counts}")
