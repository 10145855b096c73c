"""Run by check_wheels.sh under torchrun (2 gloo ranks) in a venv holding only hp-fsdp and
hp-dtensor[torch]: an MLP whose dims do not divide by 2, sharded with fully_shard, must match the
same MLP on one process after 3 AdamW steps, every parameter, in float64."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DTensor, init_device_mesh
from hp_fsdp import fully_shard


def main() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5)).double()
    model = copy.deepcopy(reference)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model[0].weight, DTensor) and model[0].weight.to_local().shape[0] == (5, 4)[rank]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 6, dtype=torch.float64)
        model(x.chunk(2)[rank]).square().mean().backward()
        reference(x).square().mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    checked = 0
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), p_ref, rtol=1e-10, atol=1e-12, msg=name)
        checked += 1
    assert checked == 4, checked
    if rank == 0:
        print(f"ok: 2-rank fully_shard MLP matches one process after 3 AdamW steps ({checked} parameters)")
    # every rank is done with its last collective before any tears its groups down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
