# mypy: disable-error-code="no-untyped-def"
"""The causal ring (colossal) against torch's own context-parallel ring attention on 4 gloo ranks
(CP groups of 2 and 4): outputs and input gradients equal, both equal to plain SDPA on the whole
sequence.  torch's public ``context_parallel`` has no sharding rule for SDPA's CPU kernel, so its
ring template runs directly with the CPU flash-attention kernels (same load-balanced split)."""

from __future__ import annotations

import random

from cp_cases import run_against_torch_ring

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=180)


def test_ring_equals_torch_context_parallel_ring(pool4: RankPool) -> None:
    rng = random.Random(2704)
    cases = [(rng.choice([2, 4]), rng.choice([1, 2]), rng.choice([1, 3, 4]), rng.choice([1, 2, 5]),
              rng.choice([4, 8]), rng.randrange(1 << 30)) for _ in range(12)]
    worst: dict[str, float] = {"ours_vs_torch": 0.0, "torch_vs_sdpa": 0.0, "ours_vs_sdpa": 0.0}
    errors = set()
    for case in cases:
        for r in pool4.run(run_against_torch_ring, *case):
            errors.add(r["public_error"])
            for what in worst:
                for name, err in r[what].items():
                    assert err < 1e-10, (case, what, name, err)
                    worst[what] = max(worst[what], err)
    print(f"ring vs torch's context-parallel ring: {len(cases)} generated fp64 causal cases "
          f"({sum(c[0] == 4 for c in cases)} at cp=4); worst relative difference {worst}; torch's "
          f"context_parallel on CPU: {sorted(errors)}")
