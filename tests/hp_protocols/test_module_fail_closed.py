# mypy: disable-error-code="import-not-found,attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""Module.parallelize fails closed on torch: a bad declaration anywhere in the tree raises the
documented error before anything changes (parameters, buffers, forward, flags), even when an
earlier module's declaration was valid; the same tree with valid declarations then parallelizes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from protocol_cases import assert_fail_closed, fail_closed_cases, good_down, good_up
from torch import nn

from hp_dtensor.testing import fake_world
from hp_protocols import Module, ShardingConfig


class Lin(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        din: int = 8
        dout: int = 16

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.randn(config.dout, config.din))
        self.bias = nn.Parameter(torch.randn(config.dout))
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


class Block(Module):
    def __init__(self, down: ShardingConfig) -> None:
        super().__init__()
        self.up = Lin.Config(sharding_config=good_up()).build()
        self.down = Lin.Config(din=16, dout=8, sharding_config=down).build()

    def forward(self, x: torch.Tensor) -> Any:
        return self.down(torch.relu(self.up(x)))


def test_parallelize_fails_closed() -> None:
    from hp_dtensor import DTensor, init_device_mesh

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        assert_fail_closed(fail_closed_cases(Block, mesh))
        ok = Block(good_down()).parallelize(mesh)
        assert isinstance(ok.up.weight, DTensor) and isinstance(ok.down.bias, DTensor)
