"""Ring attention (hp_cp, colossal) on gloo ranks against two baselines in the same run, on the
same inputs: an all-gather-KV baseline written by hand (every rank gathers the whole K/V with one
all_gather and runs masked SDPA of its queries over it) and torch's own context-parallel ring
(``torch.distributed.tensor.experimental``'s ring template over the CPU flash-attention kernels,
forward and backward, same load-balanced split: torch's public ``context_parallel`` has no
sharding rule for SDPA's CPU kernel).

Printed per sequence length: forward + backward step time of each (median of repeated steps
after warm-up, the three interleaved so machine noise hits them alike) and ours over each
baseline (target <= 1.0); the peak attention activation memory per rank (bytes of every tensor
the attention's forward and backward allocate, live at once, inputs excluded) against one
process running SDPA forward and backward on the whole sequence (target about 1/cp); and the
largest output difference to each baseline, so all are known to compute the same thing.

Run: ./pants run benchmarks/cp.py [-- --world 4]   (or python benchmarks/cp.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

from hp_dtensor.testing import RankPool

SEQS = (512, 2048, 8192)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
REPEATS, WARMUP = 7, 2


class _Memory:
    """Bytes of the tensors that ops produce while active (each storage counted from the op that
    makes it until it is freed): ``now`` live, ``peak`` the most at once."""

    def __init__(self, inputs: tuple[Any, ...] = ()) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        memory = self

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        memory._add(t.untyped_storage())
                return out

        self.mode = Track()
        # the inputs' storages are there before and after: a view of an input (a slice of the
        # queries) is not new memory, so they are entered as live with no bytes
        self.live: dict[int, int] = {t.untyped_storage().data_ptr(): 0 for t in inputs}
        self.now = self.peak = 0

    def _add(self, storage: Any) -> None:
        try:
            key = storage.data_ptr()
        except RuntimeError:  # a collective's result not materialised yet: counted when it is
            return
        if storage.nbytes() and key not in self.live:
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def _memory(fwd: Callable[[], Any], bwd: Callable[[Any], None], inputs: tuple[Any, ...]) -> tuple[int, int]:
    """(bytes the forward leaves alive for the backward, peak bytes over forward and backward),
    ``inputs`` not counted."""
    memory = _Memory(inputs)
    with memory.mode:
        kept = fwd()
        after_forward = memory.now
        bwd(kept)
        del kept
    return after_forward, memory.peak


def bench(rank: int, world: int, seq: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    from hp_cp import ContextParallel, ContextParallelConfig, rank_segments
    from hp_cp.layout import positions
    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = ContextParallel(mesh, ContextParallelConfig(degree=world, async_comm=True))
    torch_group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    full_q = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g)
    full_k, full_v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g) for _ in range(2))
    q = cp.split(full_q, dim=2).requires_grad_(True)
    k, v = (cp.split(x, dim=2).requires_grad_(True) for x in (full_k, full_v))
    qpos = torch.tensor(cp.positions(seq))
    order = torch.tensor([p for r in range(world) for p in positions(rank_segments(r, world, seq))])
    mask = order[None, :] <= qpos[:, None]

    def ring_fwd() -> torch.Tensor:
        return cp.attention(q, k, v, seq_len=seq)

    def allgather_fwd() -> torch.Tensor:
        kv = torch.stack([k, v])
        gathered = [torch.empty_like(kv) for _ in range(world)]
        dist.all_gather(gathered, kv.detach())
        gathered[rank] = kv
        full = torch.cat(gathered, dim=3)  # in the ranks' storage order; positions say where each token is
        return F.scaled_dot_product_attention(q, full[0], full[1], attn_mask=mask, enable_gqa=True)

    def autograd_bwd(out: torch.Tensor) -> None:
        out.sum().backward()

    def torch_fwd() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch_cp._templated_ring_attention(
            torch_group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            q.detach(), k.detach(), v.detach(), is_causal=True, dropout_p=0.0, scale=None)[:2]
        return out, lse

    def torch_bwd(kept: tuple[torch.Tensor, torch.Tensor]) -> None:
        out, lse = kept
        torch_cp._templated_ring_attention_backward(
            torch_group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=torch.ones_like(out), grad_out_name="grad_out", query=q.detach(), key=k.detach(),
            value=v.detach(), out=out, logsumexp=lse, is_causal=True, dropout_p=0.0, scale=None)

    methods: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
        "ring": (ring_fwd, autograd_bwd), "allgather": (allgather_fwd, autograd_bwd), "torch": (torch_fwd, torch_bwd),
    }

    def step(name: str) -> torch.Tensor:
        fwd, bwd = methods[name]
        kept = fwd()
        bwd(kept)
        return (kept[0] if isinstance(kept, tuple) else kept).detach()

    mine = step("ring")
    diff = {name: float((mine - step(name)).abs().max()) for name in ("allgather", "torch")}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(WARMUP + REPEATS):
        for name in methods:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    memory = {}
    for name, (fwd, bwd) in methods.items():
        q.grad = k.grad = v.grad = None
        dist.barrier()
        memory[name] = _memory(fwd, bwd, (q, k, v))
    if rank == 0:  # one process: SDPA (its fused kernel) forward and backward on the whole sequence
        fq, fk, fv = (x.clone().requires_grad_(True) for x in (full_q, full_k, full_v))
        memory["one_process"] = _memory(
            lambda: F.scaled_dot_product_attention(fq, fk, fv, is_causal=True, enable_gqa=True), autograd_bwd,
            (fq, fk, fv))
    return {"time": {n: statistics.median(t) for n, t in times.items()}, "memory": memory, "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="CP ranks (gloo processes)")
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS), help="sequence lengths")
    args = parser.parse_args()
    world = args.world
    print(f"context parallel attention, cp {world} gloo ranks, {os.cpu_count()} cores; heads {HEADS} "
          f"(kv {KV_HEADS}), head_dim {HEAD_DIM}, fp32, forward + backward, median of {REPEATS}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("time: forward + backward seconds (slowest rank); kept: MiB the forward leaves for the backward; peak: "
          "MiB at once over forward and backward (per rank; 1p = one process, SDPA on the whole sequence)")
    print(f"{'seq':>6} {'ring s':>8} {'all-gather':>10} {'torch':>8} {'ring/ag':>7} {'ring/torch':>10} | "
          f"{'kept ring':>9} {'ag':>6} {'torch':>6} {'1p':>6} {'ring/1p':>7} | "
          f"{'peak ring':>9} {'ag':>6} {'torch':>6} {'1p':>6} {'ring/1p':>7} | {'diff ag':>7} {'torch':>7}")
    mib = float(1 << 20)
    with RankPool(world, timeout=900) as pool:
        for seq in args.seqs:
            results = pool.run(bench, seq)
            names = list(results[0]["time"])
            t = {n: max(r["time"][n] for r in results) for n in names}
            kept = {n: max(r["memory"][n][0] for r in results) / mib for n in names}
            peak = {n: max(r["memory"][n][1] for r in results) / mib for n in names}
            kept["1p"], peak["1p"] = (x / mib for x in results[0]["memory"]["one_process"])
            d = {n: max(r["diff"][n] for r in results) for n in results[0]["diff"]}
            print(f"{seq:>6} {t['ring']:>8.4f} {t['allgather']:>10.4f} {t['torch']:>8.4f} "
                  f"{t['ring'] / t['allgather']:>7.2f} {t['ring'] / t['torch']:>10.2f} | "
                  f"{kept['ring']:>9.2f} {kept['allgather']:>6.2f} {kept['torch']:>6.2f} {kept['1p']:>6.2f} "
                  f"{kept['ring'] / kept['1p']:>7.2f} | "
                  f"{peak['ring']:>9.2f} {peak['allgather']:>6.2f} {peak['torch']:>6.2f} {peak['1p']:>6.2f} "
                  f"{peak['ring'] / peak['1p']:>7.2f} | {d['allgather']:>7.1e} {d['torch']:>7.1e}")
    print(f"target: ring/ag and ring/torch <= 1.0; kept ring/1p about 1/cp = {1 / world:.2f}")


if __name__ == "__main__":
    main()
