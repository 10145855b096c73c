"""The MindSpore backend supplies every name of the backend contract; ``init_rank`` refuses what
it cannot honour instead of ignoring it."""

from __future__ import annotations

import pytest

import hp_dtensor.platform.mindspore as ms_backend
from hp_dtensor.backend_contract import contract_gaps
from hp_dtensor.platform import current


def test_mindspore_backend_conforms() -> None:
    assert contract_gaps(ms_backend) == []
    assert current() is ms_backend


@pytest.mark.parametrize("backend", ["gloo", "nccl", "hccl"])
def test_init_rank_refuses_torch_backends(backend: str) -> None:
    with pytest.raises(ValueError, match=f"backend='{backend}' is not a MindSpore CPU communication backend"):
        ms_backend.init_rank(backend, "/unused", 0, 2, timeout_s=30)


def test_init_rank_refuses_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        ms_backend.init_rank(None, "/unused", 0, 2, timeout_s=0)


def test_init_rank_names_the_world_mismatch() -> None:
    # Without launcher variables the process is a world of one: asking for rank 0 of 2 must fail
    # naming what to set, not run as a world of one.
    with pytest.raises(RuntimeError, match="expected 0 of 2"):
        ms_backend.init_rank(None, "/unused", 0, 2, timeout_s=30)


def _launch_blocking(rank: int, world: int) -> bool:
    from mindspore._c_expression import RuntimeConf

    return bool(RuntimeConf.get_instance().is_launch_blocking())


def test_rank_pool_ranks_run_ops_synchronously() -> None:
    """Rank-pool ranks share the machine's cores: set_num_threads makes MindSpore run each op
    before the call returns; a pool that keeps the framework's defaults keeps its async queue."""
    from hp_dtensor.testing import RankPool

    env = {"HYPER_PARALLEL_PLATFORM": "mindspore"}
    with RankPool(2, timeout=120, env=env) as pool:
        assert pool.run(_launch_blocking) == [True, True]
    with RankPool(2, timeout=120, env=env, threads_per_rank=None) as pool:
        assert pool.run(_launch_blocking) == [False, False]
