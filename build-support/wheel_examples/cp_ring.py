"""Run by check_wheels.sh under torchrun (2 gloo ranks) in a venv holding only hp-cp and
hp-dtensor[torch]: ring attention over the load-balanced split must match plain causal SDPA on
the whole sequence, outputs and input gradients, in float64."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_cp import ContextParallel, ContextParallelConfig
from hp_dtensor import init_device_mesh


def main() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    cp = ContextParallel(mesh, ContextParallelConfig(degree=2))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64) for _ in range(4))
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True)
    want.backward(dout)
    local = [cp.split(x, dim=2).requires_grad_(True) for x in (q, k, v)]
    out = cp.attention(*local, seq_len=12)
    out.backward(cp.split(dout, dim=2))
    torch.testing.assert_close(out, cp.split(want.detach(), dim=2))
    for got, r in zip(local, ref):
        torch.testing.assert_close(got.grad, cp.split(r.grad, dim=2))
    if dist.get_rank() == 0:
        print("ok: 2-rank ring attention matches SDPA on the whole sequence (values and gradients)")
    # every rank is done with its last collective before any tears its groups down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
