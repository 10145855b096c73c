# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload,assignment"
"""The consumer test's runs, importable without pytest (the wheel-install check runs them in a venv
with only MindSpore, hp-protocols and hp-dtensor): build the decoder from the job YAML, load its
weights through a state-dict adapter, parallelize on the tp mesh, train with loss_parallel."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from decoder_cases import BATCH, JOB_YAML, LR, SEQ, STEPS, VOCAB, batch, weights


def checkpoint() -> str:
    """The weights as a safetensors folder (HF layout = our names here), written with numpy."""
    from safetensors.numpy import save_file

    folder = os.path.join(tempfile.gettempdir(), f"hp-consumer-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    save_file(weights(), os.path.join(folder, "model.safetensors"))
    return folder


def build(job, framework: str):
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
    loaded = SameNames().load_hf_state_dict(checkpoint())
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


def full(value) -> np.ndarray:
    from hp_dtensor import DTensor

    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return whole.asnumpy() if hasattr(whole, "asnumpy") else whole.detach().numpy()


def train_ms(rank: int, world: int, parallel: bool, optimizer: str = "adam"):
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from hp_dtensor import CommDebugMode, DTensor
    from hp_dtensor.platform import current
    from hp_protocols import JobConfig
    from hp_tp import loss_parallel

    job = JobConfig.from_yaml(JOB_YAML)
    model = build(job, "mindspore")
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
    final = {k: full(v) for k, v in current().state_dict(model).items() if k != "attn.mask"}
    return losses, final, layout, counts[0]


def train_torch(rank: int, world: int):
    """The torch run of the parity check, with plain SGD: MindSpore's Adam places eps differently
    from torch's (eps vs eps*sqrt(1-beta2^t)), which moves weights whose gradient is near zero."""
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, DTensor
    from hp_dtensor.platform import current
    from hp_protocols import JobConfig
    from hp_tp import loss_parallel

    job = JobConfig.from_yaml(JOB_YAML)
    model = build(job, "torch")
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
    final = {k: full(v) for k, v in current().state_dict(model).items() if k != "attn.mask"}
    return losses, final, layout, counts[0]
