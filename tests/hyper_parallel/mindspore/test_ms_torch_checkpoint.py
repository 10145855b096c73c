# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,call-overload,attr-defined,func-returns-value,arg-type,index"
"""A TP-sharded MLP (up: ColwiseParallel, down: RowwiseParallel) through the safetensors-shards
checkpoint across frameworks: saved by torch at tp=2 (gloo) and loaded by MindSpore at tp=4 (mccl)
and in one MindSpore process, and saved by MindSpore at tp=4 and loaded by torch at tp=2 and
unsharded -- every parameter bit-equal to the weights it was saved from.  MindSpore also loads
its own checkpoint under other layouts, and refuses damaged or missing files on every rank."""

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


def _save_bf16(rank, world, root):
    import mindspore as ms
    from mindspore import Tensor

    from hp_checkpoint.safetensors_shards import save_shards
    from hp_dtensor.layout.shard_boxes import CheckpointError
    from hyper_parallel import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    state = {"w": distribute_tensor(Tensor(np.ones((8, 2), np.float32)).astype(ms.bfloat16), mesh, [Shard(0)])}
    try:
        save_shards(state, root, 2)
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_mindspore_bfloat16_save_is_refused_on_every_rank(ms_pool) -> None:
    root = tempfile.mkdtemp()
    try:
        for msg in ms_pool.run(_save_bf16, root):
            assert "tensor 'w|" in msg and "is bfloat16, which safetensors' numpy API" in msg, msg
        assert not any(n.startswith("step-") for n in os.listdir(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
