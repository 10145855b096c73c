# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""ParallelDims.build_mesh: the dense and sparse meshes with named sub-meshes, on 4 gloo ranks
and on the fake process group at 8 and 16."""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import RankPool, fake_world, rank_pool_fixture
from hp_protocols import JobConfig

pool4 = rank_pool_fixture(4)


def _meshes(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dims = JobConfig.from_dict({"parallelism": {"tensor_parallel": 2, "expert_parallel": 2}}).resolve(world)
    dense, sparse = dims.build_mesh("cpu")
    tp, fsdp, ep = dense["tp"], dense["fsdp"], sparse["ep"]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp.get_group())
    return {
        "dense": (dense.shape, dense.mesh_dim_names),
        "sparse": (sparse.shape, sparse.mesh_dim_names),
        "tp_ranks": tp.layout.ranks, "fsdp_ranks": fsdp.layout.ranks, "ep_ranks": ep.layout.ranks,
        "tp_sum": t.item(),
    }


def test_meshes_on_4_ranks(pool4: RankPool) -> None:
    res = pool4.run(_meshes)
    for rank, r in enumerate(res):
        assert r["dense"] == ((1, 1, 2, 2), ("pp", "dp_replicate", "fsdp", "tp"))
        assert r["sparse"] == ((1, 1, 2, 2), ("pp", "dp_replicate", "efsdp", "ep"))
        base = rank - rank % 2
        assert r["tp_ranks"] == (base, base + 1) and r["tp_sum"] == 2 * base + 1
        assert r["fsdp_ranks"] == (rank % 2, rank % 2 + 2)


@pytest.mark.parametrize("world,cfg,dense,sparse", [
    (8, {"tensor_parallel": 4, "expert_parallel": 2}, (1, 1, 2, 4), (1, 1, 4, 2)),
    (16, {"data_parallel_shard": 4, "tensor_parallel": 2, "expert_parallel": 8}, (1, 2, 4, 2), (1, 2, 1, 8)),
    (16, {"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": "auto"},
     (2, 1, 4, 2), None),
])
def test_meshes_on_fake_world(world: int, cfg: dict, dense: tuple, sparse: tuple | None) -> None:
    job = JobConfig.from_dict({"parallelism": cfg, "model": {"num_hidden_layers": 4}})
    dims = job.resolve(world)
    with fake_world(world, rank=world - 1):
        d, s = dims.build_mesh("cpu")
        assert d.shape == dense and d["tp"].size() == dense[3]
        assert d.get_coordinate() == tuple(n - 1 for n in dense)
        if sparse is None:
            assert s is None
        else:
            assert s.shape == sparse and s["ep"].size() == sparse[3]
