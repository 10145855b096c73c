# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr"
"""What MindFormers does with hp_protocols, end to end on 2 MindSpore (mccl) ranks: read a seed-004
job YAML (tensor_parallel: 2), resolve it to ParallelDims and meshes, build a decoder block written
as protocol Modules with ShardingConfigs (no hp_tp), load its weights through a state-dict adapter,
parallelize it on the tp mesh, and train 3 Adam steps with loss_parallel on vocab-sharded logits.
Losses and every weight after the steps equal one MindSpore process (rtol 1.5e-4); the same block
on 2 torch (gloo) ranks from the same weights gives the same losses, weights (3 SGD steps) and
parameter layouts."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from decoder_cases import BATCH, JOB_YAML, LR, SEQ, STEPS, VOCAB, batch, weights

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}


def _checkpoint() -> str:
    """The weights as a safetensors folder (HF layout = our names here), written with numpy."""
    from safetensors.numpy import save_file

    folder = os.path.join(tempfile.gettempdir(), f"hp-consumer-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    save_file(weights(), os.path.join(folder, "model.safetensors"))
    return folder


def _build(job, framework: str):
    from hp_dtensor.platform import current
    from hp_protocols import BaseStateDictAdapter

    if framework == "mindspore":
        from ms_decoder import TinyDecoder
    else:
        from torch_decoder import TinyDecoder

    class SameNames(BaseStateDictAdapter):
        def to_hf(self, sd):
            return dict(sd)

        def from_hf(self, hf):
            return dict(hf)

    from decoder_cases import DIM, FFN

    model = TinyDecoder.Config(vocab=VOCAB, dim=DIM, heads=job.model.num_attention_heads, ffn=FFN, seq=SEQ).build()
    model.verify_module_protocol()
    loaded = SameNames().load_hf_state_dict(_checkpoint())
    state = current().state_dict(model)
    missing = sorted(set(state) - set(loaded) - {"attn.mask"})
    assert not missing, missing
    for name, value in loaded.items():
        if framework == "mindspore":
            state[name].set_data(value)
        else:
            with __import__("torch").no_grad():
                state[name].copy_(value)
    return model


def _full(value) -> np.ndarray:
    from hp_dtensor import DTensor

    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return whole.asnumpy() if hasattr(whole, "asnumpy") else whole.detach().numpy()


def _train_ms(rank: int, world: int, parallel: bool, optimizer: str = "adam"):
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from hp_dtensor import CommDebugMode, DTensor, loss_parallel
    from hp_dtensor.platform import current
    from hp_protocols import JobConfig

    job = JobConfig.from_yaml(JOB_YAML)
    model = _build(job, "mindspore")
    layout = {}
    if parallel:
        dims = job.resolve(world)
        dense, sparse = dims.build_mesh("cpu")
        assert sparse is None and dims.tp == 2 and dense.shape == (1, 1, 1, 2)
        model.parallelize(dense["tp"])
        layout = {k: tuple(v.placements) for k, v in current().state_dict(model).items() if isinstance(v, DTensor)}
    ids, tgt = batch()
    ids, tgt = Tensor(ids), Tensor(tgt.reshape(-1))
    params = model.trainable_params()
    if optimizer == "adam":
        opt = nn.Adam(params, learning_rate=LR)
    else:  # plain SGD, the one update rule both frameworks implement identically
        def opt(grads):
            for p, g in zip(params, grads):
                ops.assign_sub(p, g * LR)

    def loss_fn(ids, tgt):
        logits = model(ids)
        loss = ops.cross_entropy(logits.reshape(BATCH * SEQ, VOCAB), tgt)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses, counts = [], []
    for _ in range(STEPS):
        with loss_parallel(), CommDebugMode() as comm:
            loss, grads = grad_fn(ids, tgt)
        opt(grads)
        losses.append(float(loss.asnumpy()))
        counts.append(comm.get_comm_counts())
    final = {k: _full(v) for k, v in current().state_dict(model).items() if k != "attn.mask"}
    return losses, final, layout, counts[0]


def _train_torch(rank: int, world: int):
    """The torch run of the parity check, with plain SGD: MindSpore's Adam places eps differently
    from torch's (eps vs eps*sqrt(1-beta2^t)), which moves weights whose gradient is near zero."""
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, DTensor, loss_parallel
    from hp_dtensor.platform import current
    from hp_protocols import JobConfig

    job = JobConfig.from_yaml(JOB_YAML)
    model = _build(job, "torch")
    dense, _ = job.resolve(world).build_mesh("cpu")
    model.parallelize(dense["tp"])
    layout = {k: tuple(v.placements) for k, v in current().state_dict(model).items() if isinstance(v, DTensor)}
    ids, tgt = batch()
    ids, tgt = torch.tensor(ids, dtype=torch.long), torch.tensor(tgt.reshape(-1), dtype=torch.long)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, counts = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        with loss_parallel(), CommDebugMode() as comm:
            loss = F.cross_entropy(model(ids).reshape(BATCH * SEQ, VOCAB), tgt)
            loss.backward()
        opt.step()
        losses.append(float(loss.full_tensor()))
        counts.append(comm.get_comm_counts())
    final = {k: _full(v) for k, v in current().state_dict(model).items() if k != "attn.mask"}
    return losses, final, layout, counts[0]


@pytest.fixture(scope="module")
def ms_runs(ms_pool: RankPool):
    return ms_pool.run(_train_ms, True), _train_ms(0, 1, False)


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
    runs = ms_pool.run(_train_ms, True, "sgd")
    t_runs = torch_pool.run(_train_torch)
    for rank, ((m_losses, m_w, m_layout, m_counts), (t_losses, t_w, t_layout, t_counts)) in enumerate(zip(runs, t_runs)):
        np.testing.assert_allclose(m_losses, t_losses, err_msg=f"rank {rank} losses", **TOL)
        assert m_layout == t_layout
        for name in sorted(t_w):
            np.testing.assert_allclose(m_w[name], t_w[name], err_msg=f"rank {rank} {name}", **TOL)
        print(f"rank {rank}: mindspore {m_counts} torch {t_counts}")
