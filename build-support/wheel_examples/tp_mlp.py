"""Run by check_wheels.sh under torchrun (2 gloo ranks) in a venv holding only hp-tp and
hp-dtensor[torch]: a column -> row parallel MLP must match the same MLP on one process,
output and every weight gradient, in float64."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DTensor, init_device_mesh
from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 6)).double()


def main() -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(1)
    x = torch.randn(5, 6, dtype=torch.float64)

    reference = make_mlp()
    ref_out = reference(x)
    ref_out.square().sum().backward()

    model = parallelize_module(make_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    weight = model[0].weight
    assert isinstance(weight, DTensor), type(weight)
    assert weight.to_local().shape == (5, 6), weight.to_local().shape  # rows split over 2 ranks
    out = model(x)
    out.square().sum().backward()

    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    checked = 0
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, p_ref.grad, rtol=1e-12, atol=1e-12, msg=name)
        checked += 1
    assert checked == 4, checked
    if dist.get_rank() == 0:
        print(f"ok: 2-rank TP MLP matches one process (output and {checked} gradients)")
    # every rank is done with its last collective before any tears its groups down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
