# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Geometry at 8 and 16 ranks in one process over the fake process group: mesh slicing, local
shapes and offsets of distributed tensors, and the shapes redistribution produces."""

from __future__ import annotations

import pytest

from hp_dtensor import Partial, Replicate, Shard, init_device_mesh
from hp_dtensor.layout.shard_geometry import local_offset
from hp_dtensor.testing import fake_world


@pytest.mark.parametrize("world,rank", [(8, 5), (16, 11)])
def test_local_shapes_and_redistribute_shapes(world: int, rank: int) -> None:
    import torch

    from hp_dtensor.platform.torch import distribute_tensor

    with fake_world(world, rank=rank):
        mesh = init_device_mesh("cpu", (2, 2, world // 4), mesh_dim_names=("pp", "dp", "tp"))
        coord = mesh.get_coordinate()
        assert coord is not None and mesh.layout.rank_at(coord) == rank
        tp = mesh["tp"]
        assert tp.size() == world // 4 and tp.get_local_rank() == coord[2]
        dp_tp = mesh["dp", "tp"]
        assert dp_tp.shape == (2, world // 4)
        x = torch.zeros(16, 32, 8)
        pl = [Replicate(), Shard(0), Shard(1)]
        d = distribute_tensor(x, mesh, pl, src_data_rank=None)
        assert tuple(d.to_local().shape) == (8, 32 // (world // 4), 8)
        assert local_offset((16, 32, 8), mesh.shape, tuple(pl), coord) == (8 * coord[1], (32 // (world // 4)) * coord[2], 0)
        y = d.redistribute(mesh, [Partial(), Shard(2), Replicate()])
        assert tuple(y.to_local().shape) == (16, 32, 4) and tuple(y.shape) == (16, 32, 8)


def test_non_divisible_mesh_shape_is_rejected() -> None:
    with fake_world(8):
        with pytest.raises(ValueError, match="needs 12 ranks but the world has 8"):
            init_device_mesh("cpu", (3, 4))


def test_vocab_sharded_on_two_mesh_dims_is_rejected() -> None:
    import torch
    import torch.nn.functional as F

    from hp_dtensor.platform.torch import distribute_tensor

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2))
        table = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0), Shard(0)], src_data_rank=None)
        ids = distribute_tensor(torch.zeros(2, 3, dtype=torch.long), mesh, [Replicate(), Replicate()],
                                src_data_rank=None)
        with pytest.raises(NotImplementedError, match="more than one mesh dim"):
            F.embedding(ids, table)
