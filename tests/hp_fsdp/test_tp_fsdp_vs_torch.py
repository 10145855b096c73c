# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""TP + FSDP against torch's own ``fully_shard`` + ``torch.distributed.tensor.parallel`` on the same
model, weights and data, 4 gloo ranks on a ``(dp=2, tp=2)`` mesh: two MLP blocks (Colwise in,
Rowwise out) each ``fully_shard``-ed with ``reshard_after_forward=True`` and the root (one more
Linear) with ``False``.

Every step's collectives are pinned per phase (forward, backward), per kind and per mesh dim, and
equal torch's, counted in the same run: ours with hyper-parallel's ``CommDebugMode``, torch's with
torch's, and both attributed to mesh dims by one observer of the c10d ops (``comm_groups``).  The
root's Linear sits after the blocks ("head", the layout that used to gather the root once more in
backward: 3 all_gathers where torch issues 2) or before them ("first").  Every gradient and
parameter shard equals torch's after each of 3 AdamW steps.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from comm_groups import GroupLog, kinds_only, local, torch_counts
from torch import nn

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)


class MLP(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, root_first: bool, d: int = 8, h: int = 12) -> None:
        super().__init__()
        self.root_first = root_first
        self.blocks = nn.ModuleList([MLP(d, h), MLP(d, h)])
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.root_first:
            x = self.lin(x)
        for b in self.blocks:
            x = b(x)
        return x if self.root_first else self.lin(x)


def _both(rank: int, world: int, root_first: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchComm
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_fsdp import fully_shard
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    base = Model(root_first)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tmesh = torch_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for b in ours.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(ours, mesh=mesh["dp"], reshard_after_forward=False)
    for b in theirs.blocks:
        torch_parallelize(b, tmesh["tp"], {"up": TorchColwise(), "down": TorchRowwise()})
        torch_fully_shard(b, mesh=tmesh["dp"], reshard_after_forward=True)
    torch_fully_shard(theirs, mesh=tmesh["dp"], reshard_after_forward=False)
    names = {mesh.group_ranks(0): "dp", mesh.group_ranks(1): "tp"}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(7)
    steps: list[dict[str, Any]] = []
    worst = 0.0
    compared = 0
    for _step in range(3):
        x = torch.randn(8, 8, generator=gen).chunk(2)[mesh.get_local_rank(0)]  # dp splits the batch
        seen: dict[str, Any] = {}
        for who, model, mode, count in (
            ("ours", ours, CommDebugMode, lambda c: c.get_comm_counts()),
            ("torch", theirs, TorchComm, torch_counts),
        ):
            with mode() as comm, GroupLog() as log:
                y = model(x)
            seen[f"{who} forward"] = (log.counts(names), log.bytes(names), count(comm))
            with mode() as comm, GroupLog() as log:
                y.square().mean().backward()
            seen[f"{who} backward"] = (log.counts(names), log.bytes(names), count(comm))
        steps.append(seen)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert local(p.grad).shape == local(q.grad).shape, (local(p.grad).shape, local(q.grad).shape)
            worst = max(worst, float((local(p.grad) - local(q.grad)).abs().max()))
            compared += 1
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            worst = max(worst, float((local(p) - local(q)).abs().max()))
            with torch.no_grad():
                worst = max(worst, float((p.full_tensor() - q.full_tensor()).abs().max()))
    return {"steps": steps, "worst": worst, "compared": compared}


# Per step, per phase: the collectives of one forward and one backward, by kind and mesh dim.
# Forward: the root and both blocks gather (dp); each block's Rowwise output is all_reduced (tp).
# Backward: the two blocks gather again (they resharded; the root kept its parameters), every
# group reduce_scatters its gradients (dp), and each Colwise input whose gradient is needed is
# all_reduced (tp): both blocks' when the root's Linear comes first, only the second block's when
# the first block reads the data directly.
EXPECTED = {
    True: {"forward": {"all_gather@dp": 3, "all_reduce@tp": 2},
           "backward": {"all_gather@dp": 2, "reduce_scatter@dp": 3, "all_reduce@tp": 2}},
    False: {"forward": {"all_gather@dp": 3, "all_reduce@tp": 2},
            "backward": {"all_gather@dp": 2, "reduce_scatter@dp": 3, "all_reduce@tp": 1}},
}


@pytest.mark.parametrize("root_first", [False, True], ids=["head", "first"])
def test_tp_fsdp_collectives_and_values_equal_torch(pool4: RankPool, root_first: bool) -> None:
    results = pool4.run(_both, root_first)
    for r in results:
        assert r["worst"] <= 1e-6, r["worst"]
        for step in r["steps"]:
            for phase in ("forward", "backward"):
                ours, ours_bytes, ours_own = step[f"ours {phase}"]
                theirs, theirs_bytes, theirs_own = step[f"torch {phase}"]
                assert ours == EXPECTED[root_first][phase], (phase, ours)
                assert theirs == EXPECTED[root_first][phase], (phase, theirs)
                assert ours_bytes == theirs_bytes, (phase, ours_bytes, theirs_bytes)
                # each library's own CommDebugMode saw exactly what the observer saw
                assert ours_own == kinds_only(ours), (phase, ours_own, ours)
                assert theirs_own == kinds_only(theirs), (phase, theirs_own, theirs)
    print(f"3 steps x 2 phases on 4 ranks equal torch's counts; {sum(r['compared'] for r in results)} "
          f"gradient shards compared, worst |ours - torch| {max(r['worst'] for r in results):.1e}")
