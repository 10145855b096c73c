# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
"""``reshape`` of a transposed DTensor (attention's merge of heads): torch hands it to the DTensor
as ``view`` because the wrapper is contiguous, while the local shard is not; the result is this
rank's slice of the single-tensor reshape, and gradients flow back through it."""

from __future__ import annotations

import torch

from hp_dtensor import DTensor, Shard, init_device_mesh
from hp_dtensor.testing import fake_world


def test_reshape_of_transposed_shard_is_the_local_slice() -> None:
    torch.manual_seed(0)
    whole = torch.randn(2, 4, 4, 2)  # (batch, heads, seq, head_dim), heads sharded
    with fake_world(2, rank=1):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        local = whole.chunk(2, dim=1)[1].clone().requires_grad_()
        merged = DTensor.from_local(local, mesh, [Shard(1)]).transpose(1, 2).reshape(2, 4, 8)
        assert merged.placements == (Shard(2),) and merged.shape == (2, 4, 8)
        expected = whole.transpose(1, 2).reshape(2, 4, 8).chunk(2, dim=2)[1]
        torch.testing.assert_close(merged.to_local(), expected)
        merged.to_local().sum().backward()
        torch.testing.assert_close(local.grad, torch.ones_like(local))
