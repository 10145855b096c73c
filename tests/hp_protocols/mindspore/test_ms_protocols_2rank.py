# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-arg,call-overload"
"""hp_protocols on 2 MindSpore (mccl) ranks: Module.parallelize makes the declared DTensor
parameters, reshards construct's inputs and outputs, equals one process (outputs and gradients),
runs once; a bad declaration anywhere fails closed (same errors as torch, tree unchanged); and
JobConfig -> ParallelDims -> the dense and sparse (EP) meshes, whose sub-mesh groups reduce."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from protocol_cases import assert_fail_closed

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool = rank_pool_fixture(2, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}


def _classes():
    from mindspore import Parameter, Tensor, ops

    from hp_protocols import Module, ShardingConfig

    class Lin(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            din: int = 8
            dout: int = 16
            seed: int = 0

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            rs = np.random.RandomState(config.seed)
            self.weight = Parameter(Tensor(rs.randn(config.dout, config.din).astype(np.float32)), name="weight")
            self.bias = Parameter(Tensor(rs.randn(config.dout).astype(np.float32)), name="bias")
            self.register_buffer("calls", Tensor(np.zeros((1,), np.float32)))

        def construct(self, input: Any) -> Any:
            return ops.dense(input, self.weight, self.bias)

    class Block(Module):
        def __init__(self, down: ShardingConfig | None) -> None:
            from protocol_cases import good_up

            super().__init__()
            self.up = Lin.Config(sharding_config=good_up()).build()
            self.down = Lin.Config(din=16, dout=8, seed=1, sharding_config=down).build()

        def construct(self, x: Any) -> Any:
            return self.down(ops.relu(self.up(x)))

    return Block


def _mesh(world: int):
    from hp_dtensor import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _grads(model, x):
    import mindspore as ms

    from hp_dtensor import DTensor

    params = model.trainable_params()

    def loss_fn(inp):
        y = model(inp)
        y = y.to_local() if isinstance(y, DTensor) else y
        return (y * y).sum(), y

    (_, y), grads = ms.value_and_grad(loss_fn, None, params, has_aux=True)(x)
    names = [p.name for p in params]
    return y.asnumpy(), dict(zip(names, [g.asnumpy() for g in grads]))


def _parallelize(rank: int, world: int):
    from mindspore import Tensor
    from protocol_cases import good_down

    from hp_dtensor import DTensor
    from hp_dtensor.platform import current

    Block = _classes()
    model = Block(good_down()).parallelize(_mesh(world))
    x = Tensor(np.random.RandomState(2).randn(4, 8).astype(np.float32))
    y, grads = _grads(model, x)
    state = current().state_dict(model)
    try:
        model.up.parallelize(_mesh(world))
        again = "no error"
    except RuntimeError as e:
        again = str(e)
    return {
        "placements": {k: v.placements for k, v in state.items() if isinstance(v, DTensor)},
        "local": tuple(model.up.weight.to_local().shape),
        "y": y, "grads": grads, "again": again,
    }


def test_parallelize_matches_one_process(pool: RankPool) -> None:
    from mindspore import Tensor
    from protocol_cases import good_down

    from hp_dtensor import Replicate, Shard

    Block = _classes()
    ref = Block(good_down())  # not parallelized: plain Cells on this process
    ref_y, ref_g = _grads(ref, Tensor(np.random.RandomState(2).randn(4, 8).astype(np.float32)))
    res = pool.run(_parallelize)
    for r in res:
        assert r["placements"] == {"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),),
                                   "down.bias": (Replicate(),)}
        assert r["local"] == (8, 8) and "already applied" in r["again"]
        np.testing.assert_allclose(r["y"], ref_y, **TOL)
        np.testing.assert_allclose(r["grads"]["down.bias"], ref_g["down.bias"], **TOL)
    cat = {k: np.concatenate([r["grads"][k] for r in res], axis=d)
           for k, d in (("up.weight", 0), ("up.bias", 0), ("down.weight", 1))}
    for k, v in cat.items():
        np.testing.assert_allclose(v, ref_g[k], err_msg=k, **TOL)


def _fail_closed(rank: int, world: int):
    from protocol_cases import fail_closed_cases

    return fail_closed_cases(_classes(), _mesh(world))


def test_parallelize_fails_closed_on_every_rank(pool: RankPool) -> None:
    for results in pool.run(_fail_closed):
        assert_fail_closed(results)


def _meshes(rank: int, world: int, parallelism: dict):
    from mindspore import Tensor, ops

    from hp_protocols import JobConfig

    dims = JobConfig.from_dict({"parallelism": parallelism}).resolve(world)
    dense, sparse = dims.build_mesh("cpu")
    out = {"dense": (dense.shape, dense.mesh_dim_names), "sparse": (sparse.shape, sparse.mesh_dim_names)}
    for name, mesh, axis in (("tp", dense, "tp"), ("fsdp", dense, "fsdp"), ("ep", sparse, "ep")):
        sub = mesh[axis]
        t = Tensor(np.array([float(rank + 1)], np.float32))
        out[name] = (sub.layout.ranks, float(ops.AllReduce(group=sub.get_group())(t).asnumpy()[0]) if sub.size() > 1
                     else float(rank + 1))
    return out


@pytest.mark.parametrize("parallelism,dense,sparse,tp,fsdp", [
    ({"tensor_parallel": 2, "expert_parallel": 2}, (1, 1, 1, 2), (1, 1, 1, 2), (0, 1), None),
    ({"data_parallel_shard": 2, "expert_parallel": 2}, (1, 1, 2, 1), (1, 1, 1, 2), None, (0, 1)),
])
def test_job_config_to_meshes_on_mindspore_ranks(pool: RankPool, parallelism, dense, sparse, tp, fsdp) -> None:
    res = pool.run(_meshes, parallelism)
    for rank, r in enumerate(res):
        assert r["dense"] == (dense, ("pp", "dp_replicate", "fsdp", "tp"))
        assert r["sparse"] == (sparse, ("pp", "dp_replicate", "efsdp", "ep"))
        # The EP group spans both ranks in both layouts: its all_reduce sums 1 + 2.
        assert r["ep"] == ((0, 1), 3.0)
        assert r["tp"] == ((0, 1), 3.0) if tp else r["tp"] == ((rank,), float(rank + 1))
        assert r["fsdp"] == ((0, 1), 3.0) if fsdp else r["fsdp"] == ((rank,), float(rank + 1))
