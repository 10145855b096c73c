# mypy: disable-error-code="no-untyped-def"
"""Ulysses (cp=2 and cp=4) and hybrid (cp=4, ulysses 2 inside, ring of 2 across) attention on 4
gloo ranks against plain SDPA on the whole sequence in one process: outputs and input gradients,
fp64 and fp32, causal and EOD masks, odd head counts per rank, GQA with fewer key/value heads than
the ulysses degree; exactly four all-to-alls each way and the ring's exchanges."""

from __future__ import annotations

from cp_cases import generate_cases, run_attention_case

from hp_cp import CPMethod
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


def _collectives(case) -> tuple[dict[str, int], dict[str, int]]:
    """What one attention call must issue forward and backward: the ring's exchanges over
    ``cp / ulysses`` participants, and four all-to-alls (q, k, v in; the output back) each way
    when ulysses runs."""
    u = case.ulysses or 1
    ring = case.cp // u
    fwd, bwd = {}, {}
    if ring > 1:
        fwd["send_recv"], bwd["send_recv"] = ring - 1, 2 * ring - 1
    if u > 1:
        fwd["all_to_all"] = bwd["all_to_all"] = 4
    return fwd, bwd


def test_ulysses_and_hybrid_match_sdpa_on_the_whole_sequence(pool4: RankPool) -> None:
    cases = generate_cases(36, seed=2702, methods=(CPMethod.ULYSSES, CPMethod.HYBRID), world=4)
    worst = {"float64": 0.0, "float32": 0.0}
    for case in cases:
        results = pool4.run(run_attention_case, case)
        errs = _check(results, case)
        worst[case.dtype] = max(worst[case.dtype], *errs.values())
        fwd, bwd = _collectives(case)
        for r in results:
            assert r["fwd"] == fwd, (case, r["fwd"])
            assert r["bwd"] == bwd, (case, r["bwd"])
    few_kv = sum(c.kv_heads % (c.ulysses or 1) != 0 for c in cases)
    print(f"ulysses/hybrid attention: {len(cases)} generated cases "
          f"({sum(c.method is CPMethod.HYBRID for c in cases)} hybrid cp=4 u=2, {sum(c.eod for c in cases)} EOD, "
          f"{few_kv} with key/value heads replicated up to the query heads); worst relative error {worst}")
