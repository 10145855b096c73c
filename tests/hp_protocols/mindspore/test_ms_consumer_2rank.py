# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""What MindFormers does with hp_protocols, end to end on 2 MindSpore (mccl) ranks: read a seed-004
job YAML (tensor_parallel: 2), resolve it to ParallelDims and meshes, build a decoder block written
as protocol Modules with ShardingConfigs (no hp_tp), load its weights through a state-dict adapter,
parallelize it on the tp mesh, and train 3 Adam steps with loss_parallel on vocab-sharded logits.
Losses and every weight after the steps equal one MindSpore process (rtol 1.5e-4); the same block
on 2 torch (gloo) ranks from the same weights gives the same losses, weights (3 SGD steps) and
parameter layouts."""

from __future__ import annotations

import numpy as np
import pytest
from consumer_cases import train_ms, train_torch

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def ms_runs(ms_pool: RankPool):
    return ms_pool.run(train_ms, True), train_ms(0, 1, False)


def test_decoder_block_trains_like_one_process(ms_runs) -> None:
    from hp_dtensor import Replicate, Shard

    runs, (ref_losses, ref_w, _, _) = ms_runs
    for rank, (losses, final, layout, _) in enumerate(runs):
        np.testing.assert_allclose(losses, ref_losses, err_msg=f"rank {rank} losses", **TOL)
        assert set(final) == set(ref_w)
        for name in sorted(ref_w):
            np.testing.assert_allclose(final[name], ref_w[name], err_msg=f"rank {rank} {name}", **TOL)
        assert layout["embed.weight"] == (Shard(0),) and layout["lm_head.weight"] == (Shard(0),)
        assert layout["attn.q_proj.weight"] == (Shard(0),) and layout["mlp.down.weight"] == (Shard(1),)
        assert layout["norm.weight"] == (Replicate(),) and layout["attn.mask"] == (Replicate(),)
        assert len(layout) == 13
    assert ref_losses[2] < ref_losses[0]  # it learns


def test_same_numbers_on_torch(ms_pool: RankPool, torch_pool: RankPool) -> None:
    runs = ms_pool.run(train_ms, True, "sgd")
    t_runs = torch_pool.run(train_torch)
    for rank, ((m_losses, m_w, m_layout, m_counts), (t_losses, t_w, t_layout, t_counts)) in enumerate(zip(runs, t_runs)):
        np.testing.assert_allclose(m_losses, t_losses, err_msg=f"rank {rank} losses", **TOL)
        assert m_layout == t_layout
        for name in sorted(t_w):
            np.testing.assert_allclose(m_w[name], t_w[name], err_msg=f"rank {rank} {name}", **TOL)
        print(f"rank {rank}: mindspore {m_counts} torch {t_counts}")
