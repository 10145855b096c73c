# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""Colwise -> Rowwise with a hidden size that does not divide by the TP degree, on 4 gloo ranks:
7 columns give shards of 2, 2, 2, 1 and 3 columns give 1, 1, 1, 0 (an empty shard).  Outputs and
every gradient equal one process in float64.  Before, the Rowwise layer wrapped its plain local
input assuming even shards, so ranks derived different global shapes and a collective aborted a
rank."""

from __future__ import annotations

import copy

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=180)


def _mlp(rank: int, world: int, hidden: int) -> float:
    import torch
    from torch import nn

    from hp_dtensor import DTensor, init_device_mesh
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 5)).double()
    model = copy.deepcopy(ref)
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 5, dtype=torch.float64)
    out = model(x)
    want = ref(x)
    out.square().sum().backward()
    want.square().sum().backward()
    worst = float((out - want).abs().max())
    for p, rp in zip(model.parameters(), ref.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((g - rp.grad).abs().max()))
    return worst


@pytest.mark.parametrize("hidden", [7, 3])
def test_colwise_rowwise_with_uneven_hidden(pool4: RankPool, hidden: int) -> None:
    assert max(pool4.run(_mlp, hidden)) < 1e-12
