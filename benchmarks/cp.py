"""Ring attention (hp_cp, colossal) on 2 gloo ranks against an all-gather-KV baseline written by
hand (every rank gathers the whole K/V with one all_gather and runs causal SDPA of its queries over
it), same run, same inputs.

Printed per sequence length: forward + backward step time of each (median of repeated steps after
warm-up, the two interleaved so machine noise hits both alike) and their ratio (target <= 1.0);
the largest single tensor each allocates per rank against one process's attention scores
(S x S per head), the share of the activation memory context parallelism exists to cut; and the
largest output difference between the two, so they are known to compute the same thing.

Run: ./pants run benchmarks/cp.py   (or python benchmarks/cp.py)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from hp_dtensor.testing import RankPool

SEQS = (512, 2048)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
REPEATS, WARMUP = 7, 2


def _largest(fn: Any) -> int:
    """Elements of the largest tensor any op produces while ``fn`` runs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    with Largest() as mode:
        fn()
    return mode.numel


def bench(rank: int, world: int, seq: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hp_cp import ContextParallel, ContextParallelConfig, rank_segments
    from hp_cp.layout import positions
    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = ContextParallel(mesh, ContextParallelConfig(degree=world, async_comm=True))
    g = torch.Generator().manual_seed(0)
    q = cp.split(torch.randn(1, HEADS, seq, HEAD_DIM, generator=g), dim=2).requires_grad_(True)
    k, v = (cp.split(torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g), dim=2).requires_grad_(True)
            for _ in range(2))
    qpos = torch.tensor(cp.positions(seq))
    order = torch.tensor([p for r in range(world) for p in positions(rank_segments(r, world, seq))])
    rep = HEADS // KV_HEADS

    def ring() -> torch.Tensor:
        out = cp.attention(q, k, v, seq_len=seq)
        out.sum().backward()
        return out

    def allgather() -> torch.Tensor:
        kv = torch.stack([k, v])
        gathered = [torch.empty_like(kv) for _ in range(world)]
        dist.all_gather(gathered, kv.detach())
        gathered[rank] = kv
        full = torch.cat(gathered, dim=3)  # in the ranks' storage order; positions say where each token is
        mask = order[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(q, full[0].repeat_interleave(rep, 1), full[1].repeat_interleave(rep, 1),
                                             attn_mask=mask)
        out.sum().backward()
        return out

    diff = float((ring().detach() - allgather().detach()).abs().max())
    times: dict[str, list[float]] = {"ring": [], "allgather": []}
    for i in range(WARMUP + REPEATS):
        for name, fn in (("ring", ring), ("allgather", allgather)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    return {
        "ring": statistics.median(times["ring"]), "allgather": statistics.median(times["allgather"]),
        "largest_ring": _largest(ring), "largest_allgather": _largest(allgather), "diff": diff,
    }


def main() -> None:
    world = 2
    print(f"context parallel attention, {world} gloo ranks, {os.cpu_count()} cores; heads {HEADS} "
          f"(kv {KV_HEADS}), head_dim {HEAD_DIM}, fp32, forward + backward, median of {REPEATS}")
    print(f"{'seq':>6} {'ring s':>9} {'all-gather s':>13} {'ratio':>6} {'largest ring':>13} "
          f"{'largest all-gather':>19} {'1-process S*S*H':>16} {'max diff':>9}")
    with RankPool(world, timeout=600) as pool:
        for seq in SEQS:
            r = max(pool.run(bench, seq), key=lambda x: x["ring"])
            one = seq * seq * HEADS
            print(f"{seq:>6} {r['ring']:>9.4f} {r['allgather']:>13.4f} {r['ring'] / r['allgather']:>6.2f} "
                  f"{r['largest_ring']:>13} {r['largest_allgather']:>19} {one:>16} {r['diff']:>9.1e}")


if __name__ == "__main__":
    main()
