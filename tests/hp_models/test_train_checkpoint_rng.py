# mypy: disable-error-code="no-untyped-def"
"""The trainer refuses to checkpoint when the ranks' CPU generators differ (one saved state could
not restore them all): the same ``CheckpointError`` on every rank, after one counted object
gather, and no error when they agree."""

from __future__ import annotations

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=120)


def _check(rank: int, world: int, same: bool) -> tuple[str, dict[str, int]]:
    import torch

    from hp_dtensor import CommDebugMode
    from hp_models.train_checkpoint import CheckpointError, _check_rng_agrees

    torch.manual_seed(1234 if same else 1234 + rank)
    with CommDebugMode() as comm:
        try:
            _check_rng_agrees()
            verdict = "ok"
        except CheckpointError as e:
            verdict = f"CheckpointError: {e}"
    return verdict, dict(comm.get_comm_counts())


def test_differing_generators_are_refused_on_every_rank(pool2: RankPool) -> None:
    for verdict, counts in pool2.run(_check, False):
        assert verdict.startswith("CheckpointError: checkpoint: the ranks' CPU generator states differ"), verdict
        assert counts == {"all_gather_object": 1}, counts
    for verdict, counts in pool2.run(_check, True):
        assert verdict == "ok" and counts == {"all_gather_object": 1}, (verdict, counts)
