# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,call-overload,attr-defined,func-returns-value,arg-type,index"
"""A TP-sharded MLP (up: ColwiseParallel, down: RowwiseParallel) through the safetensors-shards
checkpoint across frameworks: saved by torch at tp=2 (gloo) and loaded by MindSpore at tp=4 (mccl)
and in one MindSpore process, and saved by MindSpore at tp=4 and loaded by torch at tp=2 and
unsharded -- every parameter bit-equal to the weights it was saved from.  MindSpore also loads
its own checkpoint under other layouts, and refuses damaged or missing files on every rank.
bfloat16 crosses in both directions bit for bit."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from ms_cases import ms_mlp, weights
from torch_cases import t_mlp

from hp_dtensor.testing import rank_pool_fixture

ms_pool = rank_pool_fixture(4, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=120, env={"HYPER_PARALLEL_PLATFORM": "torch"})
NAMES = {"up.weight": "w1", "up.bias": "b1", "down.weight": "w2", "down.bias": "b2"}


def _parallel(model, world, tp):
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module

    if tp == 1:
        return model
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp < world else \
        init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _full_numpy(v):
    whole = v.full_tensor() if hasattr(v, "full_tensor") else v
    return whole.detach().numpy() if hasattr(whole, "detach") else whole.asnumpy()


def _save(rank, world, framework, seed, tp, root):
    from hp_checkpoint.safetensors_shards import save_shards
    from hp_dtensor.platform import current

    model = _parallel((t_mlp if framework == "torch" else ms_mlp)(weights(seed)), world, tp)
    return save_shards(current().state_dict(model), root, 1, extra={"saved_by": framework})


def _load(rank, world, framework, seed, tp, path):
    from hp_checkpoint.safetensors_shards import load_shards
    from hp_dtensor.platform import current

    model = _parallel((t_mlp if framework == "torch" else ms_mlp)(weights(seed)), world, tp)
    state = current().state_dict(model)
    load_shards(state, path)
    return {k: _full_numpy(v) for k, v in current().state_dict(model).items()}


def _check(got, seed):
    W = weights(seed)
    assert sorted(got) == sorted(NAMES)
    for k, name in NAMES.items():
        assert got[k].dtype == W[name].dtype and np.array_equal(got[k], W[name]), k


def test_torch_tp2_to_mindspore_tp4_and_one_process(ms_pool, torch_pool) -> None:
    root = tempfile.mkdtemp()
    try:
        path = torch_pool.run(_save, "torch", 21, 2, root)[0]
        for got in ms_pool.run(_load, "mindspore", 99, 4, path):
            _check(got, 21)
        for got in ms_pool.run(_load, "mindspore", 99, 2, path):  # tp=2 over a (2, 2) mesh: replicas
            _check(got, 21)
        _check(_load(0, 1, "mindspore", 98, 1, path), 21)  # this process: MindSpore, no process group
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_mindspore_tp4_to_torch_tp2_and_unsharded(ms_pool, torch_pool) -> None:
    root = tempfile.mkdtemp()
    try:
        path = ms_pool.run(_save, "mindspore", 33, 4, root)[0]
        for tp in (2, 1):
            for got in torch_pool.run(_load, "torch", 5, tp, path):
                _check(got, 33)
        for got in ms_pool.run(_load, "mindspore", 6, 2, path):  # and MindSpore under another layout
            _check(got, 33)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _load_refused(rank, world, path):
    from hp_dtensor.layout.shard_boxes import CheckpointError

    try:
        _load(rank, world, "mindspore", 1, 4, path)
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("damage,message", [("corrupt", "is corrupted"), ("missing", "is missing")])
def test_damaged_torch_checkpoint_is_refused_by_mindspore(ms_pool, torch_pool, damage, message) -> None:
    root = tempfile.mkdtemp()
    try:
        path = torch_pool.run(_save, "torch", 21, 2, root)[0]
        victim = os.path.join(path, "shard-rank00000.safetensors")
        if damage == "corrupt":
            with open(victim, "r+b") as f:
                f.seek(-3, 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 1]))
        else:
            os.remove(victim)
        for msg in ms_pool.run(_load_refused, path):
            assert "'shard-rank00000.safetensors' " + message in msg, msg
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _bf16_values(seed):
    """bfloat16 bit patterns (uint16) of a (10, 6) weight -- uneven over 4 ranks -- with the
    values a careless checkpoint would mangle: -0.0, infinities, NaN, a subnormal -- and a (6,)
    bias.  (The NaN is the canonical quiet one: MindSpore's float32 -> bfloat16 cast, which
    builds the tensors, drops a NaN's payload bits.)"""
    rs = np.random.RandomState(seed)
    w = (rs.randn(10, 6).astype(np.float32) * 3).view(np.uint32) >> 16
    w.reshape(-1)[:5] = [0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001]
    b = (rs.randn(6).astype(np.float32)).view(np.uint32) >> 16
    return {"w": w.astype(np.uint16), "b": b.astype(np.uint16)}


def _bf16_state(framework, world, seed):
    """The state dict of ``_bf16_values(seed)`` as bfloat16 DTensors: ``w`` Shard(0), ``b``
    replicated, ``f`` a float32 neighbour."""
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    values = _bf16_values(seed)
    if framework == "torch":
        import torch

        def make(bits):
            return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)

        f = torch.arange(3, dtype=torch.float32)
    else:
        import mindspore as ms
        from mindspore import Tensor

        def make(bits):
            return Tensor((bits.astype(np.uint32) << 16).view(np.float32)).astype(ms.bfloat16)

        f = Tensor(np.arange(3, dtype=np.float32))
    return {"w": distribute_tensor(make(values["w"]), mesh, [Shard(0)]),
            "b": distribute_tensor(make(values["b"]), mesh, [Replicate()]),
            "f": distribute_tensor(f, mesh, [Replicate()])}


def _bits(v):
    """A (DTensor) bfloat16 tensor's bit patterns, whole, as uint16."""
    whole = v.full_tensor()
    if hasattr(whole, "detach"):
        import torch

        return whole.detach().view(torch.int16).numpy().view(np.uint16) if whole.dtype == torch.bfloat16 \
            else whole.detach().numpy()
    import mindspore as ms

    if whole.dtype == ms.bfloat16:
        return (whole.astype(ms.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
    return whole.asnumpy()


def _save_bf16(rank, world, framework, seed, root):
    from hp_checkpoint.safetensors_shards import save_shards

    return save_shards(_bf16_state(framework, world, seed), root, 3)


def _load_bf16(rank, world, framework, path):
    from hp_checkpoint.safetensors_shards import load_shards

    state = _bf16_state(framework, world, 999)
    load_shards(state, path)
    return {k: _bits(v) for k, v in state.items()}


def _check_bf16(got, seed):
    want = _bf16_values(seed)
    for k in ("w", "b"):
        assert got[k].dtype == np.uint16 and np.array_equal(got[k], want[k]), k
    assert np.array_equal(got["f"], np.arange(3, dtype=np.float32))


def test_bfloat16_crosses_frameworks_bit_exact(ms_pool, torch_pool) -> None:
    """bfloat16 saved by MindSpore at 4 ranks loads in torch at 2 and back in MindSpore; saved by
    torch at 2 it loads in MindSpore at 4 -- every bit pattern kept (-0.0, infinities, NaN, a
    subnormal)."""
    root = tempfile.mkdtemp()
    try:
        ms_path = ms_pool.run(_save_bf16, "mindspore", 7, os.path.join(root, "ms"))[0]
        for got in torch_pool.run(_load_bf16, "torch", ms_path):
            _check_bf16(got, 7)
        for got in ms_pool.run(_load_bf16, "mindspore", ms_path):
            _check_bf16(got, 7)
        torch_path = torch_pool.run(_save_bf16, "torch", 8, os.path.join(root, "torch"))[0]
        for got in ms_pool.run(_load_bf16, "mindspore", torch_path):
            _check_bf16(got, 8)
        print("bfloat16 (10, 6) + (6,) entries: MindSpore 4 ranks -> torch 2 and MindSpore 4, torch 2 -> "
              "MindSpore 4, bit-equal")
    finally:
        shutil.rmtree(root, ignore_errors=True)
