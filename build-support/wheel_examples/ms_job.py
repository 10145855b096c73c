"""Run by check_wheels.sh in a venv holding only hp-protocols and hp-dtensor[mindspore] (no
torch): the platform is MindSpore without being asked for, and a job config resolves into a mesh
and a DTensor on this one process (a world of one)."""

from __future__ import annotations

import importlib.util

import mindspore as ms

import hp_protocols
from hp_dtensor import DTensor, Replicate, Shard, distribute_tensor
from hp_dtensor.platform import current
from hp_protocols import JobConfig


def main() -> None:
    assert importlib.util.find_spec("torch") is None, "torch is installed next to hp-dtensor[mindspore]"
    assert current().__name__ == "hp_dtensor.platform.mindspore", current().__name__

    job = JobConfig.from_dict({"parallelism": {"data_parallel_shard": -1, "tensor_parallel": 1}})
    dims = job.resolve(world_size=1)
    assert (dims.dp_shard, dims.tp, dims.pp) == (1, 1, 1), dims
    dense, sparse = dims.build_mesh("cpu")
    assert sparse is None and dense.mesh_dim_names == ("pp", "dp_replicate", "fsdp", "tp"), dense

    x = ms.Tensor([[1.0, 2.0], [3.0, 4.0]], ms.float32)
    dx = distribute_tensor(x, dense, [Replicate(), Replicate(), Shard(0), Replicate()])
    assert isinstance(dx, DTensor) and tuple(dx.shape) == (2, 2), dx
    total = float((dx * 2).full_tensor().sum().asnumpy())
    assert total == 20.0, total
    print(f"ok: hp-protocols {hp_protocols.__version__} JobConfig -> mesh {dims.dense_mesh_shape()} on MindSpore, sum {total}")


if __name__ == "__main__":
    main()
