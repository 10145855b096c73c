# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Module.parallelize on 2 gloo ranks: declared shardings make DTensor params, forward reshards
inputs/outputs as declared, numbers equal one device; it runs once and recurses."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2)


def _build() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from hp_dtensor import Replicate, Shard
    from hp_protocols import MeshAxisName, Module, ShardingConfig

    TP = MeshAxisName.TP

    class ColLinear(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            din: int = 8
            dout: int = 16

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.weight = nn.Parameter(torch.randn(config.dout, config.din))
            self.bias = nn.Parameter(torch.randn(config.dout))

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return F.linear(input, self.weight, self.bias)

    class RowLinear(ColLinear):
        pass

    class Block(Module):
        def __init__(self, config: Module.Config | None = None) -> None:
            super().__init__(config)
            self.up = ColLinear.Config(sharding_config=ShardingConfig(
                state_shardings={"weight": {TP: Shard(0)}, "bias": {TP: Shard(0)}},
                in_dst_shardings={"input": {TP: Replicate()}},
                out_dst_shardings={"output": {TP: Shard(-1)}},
            )).build()
            self.down = RowLinear.Config(din=16, dout=8, sharding_config=ShardingConfig(
                state_shardings={"weight": {TP: Shard(1)}},
                in_dst_shardings={"input": {TP: Shard(-1)}},
                out_dst_shardings={"output": {TP: Replicate()}},
            )).build()

        def forward(self, x: torch.Tensor) -> Any:
            return self.down(torch.relu(self.up(x)))

    return Block()


def _parallelize_case(rank: int, world: int) -> dict[str, Any]:
    import torch

    from hp_dtensor import init_device_mesh

    torch.manual_seed(0)
    ref = _build()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model.parallelize(mesh)
    x = torch.randn(4, 8)
    y = model(x)
    y_ref = ref(x)
    torch.testing.assert_close(y.full_tensor(), y_ref, rtol=1.5e-4, atol=1e-5)
    y.full_tensor().pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1.5e-4, atol=1e-5, msg=n)
    try:
        model.up.parallelize(mesh)
        again = "no error"
    except RuntimeError as e:
        again = str(e)
    return {
        "placements": {n: p.placements for n, p in model.named_parameters()},
        "local": tuple(model.up.weight.to_local().shape),
        "out": y.placements,
        "again": again,
    }


def test_parallelize_matches_one_device(pool2: RankPool) -> None:
    from hp_dtensor import Replicate, Shard

    for res in pool2.run(_parallelize_case):
        assert res["placements"] == {"up.weight": (Shard(0),), "up.bias": (Shard(0),),
                                     "down.weight": (Shard(1),), "down.bias": (Replicate(),)}
        assert res["local"] == (8, 8) and res["out"] == (Replicate(),)
        assert "already applied" in res["again"]
