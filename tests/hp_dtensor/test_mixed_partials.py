"""Partial("sum") mixed with Partial("avg") on 4 gloo ranks against float64 arithmetic
(``hp_dtensor.testing.mixed_partial_cases``; the MindSpore suite runs the same cases)."""

from __future__ import annotations

from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_dtensor.testing.mixed_partial_cases import check_mixed_partials, mixed_partial_case

pool4 = rank_pool_fixture(4)


def _cases(rank: int, world: int) -> dict[str, object]:
    import torch

    def tensor(v: Any) -> Any:
        return torch.tensor(v, dtype=torch.float64)

    return mixed_partial_case(rank, world, tensor, lambda t: t.tolist())


def test_sum_and_avg_partials_mix_with_torchs_numbers(pool4: RankPool) -> None:
    """torch.distributed.tensor accepts sum and avg Partials together (they commute) and refuses
    other mixes; the values must be the float64 reference's."""
    n = check_mixed_partials(pool4.run(_cases))
    print(f"mixed Partial cases: {n} checked over 4 ranks")
