"""Expert parallelism (hp_ep's ``ExpertParallel``) on an MoE layer at ep=2 and ep=4 gloo ranks,
against two baselines measured in the same run on the same weights and tokens:

- an all-gather-all-experts baseline written by hand: each rank stores 1/ep of the stacked
  experts like EP does, all-gathers every expert's weights before the layer
  (``all_gather_single``), runs all experts on its own tokens and reduce-scatters the expert
  gradients back (``reduce_scatter_single``) -- the FSDP way to spread experts;
- one process running every rank's tokens through every expert (the work EP divides).

Printed per tokens-per-rank: forward + backward step time of each (median of repeated steps after
warm-up, interleaved so machine noise hits them alike), ours / all-gather (target <= 1.0 at the
larger size) and ours / one process; expert parameter bytes per rank at rest and at the peak of a
step against one process's (EP keeps 1/ep throughout; the all-gather baseline holds every expert
while the layer runs); and the largest output difference, so they are known to compute the same.

A last table runs the ``alltoall_deredundancy`` dispatcher (ep=4 in nodes of 2 ranks, top-4)
against plain all-to-all in the same run: step times, and the bytes that cross nodes (counted from
each forward's dispatch plan: token rows there and back, per copy a weight and a descriptor).

Run: ./pants run benchmarks/ep.py   (or python benchmarks/ep.py)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from hp_dtensor.testing import RankPool

TOKENS = (128, 512)  # per rank
HIDDEN, EXPERT_INTER, EXPERTS, TOP_K = 256, 512, 8, 2
DEDUP_TOP_K = 4  # several experts per token, so tokens share destination nodes
REPEATS, WARMUP = 5, 1


def _config(top_k: int = TOP_K) -> Any:
    from hp_models.qwen3_5_moe import tiny_moe_config

    return tiny_moe_config(hidden_size=HIDDEN, moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
                           num_experts_per_tok=top_k, shared_expert_intermediate_size=HIDDEN)


def bench(rank: int, world: int, tokens: int) -> dict[str, Any]:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hp_dtensor import init_device_mesh
    from hp_ep import ExpertParallel
    from hp_models.qwen3_5_moe import SparseMoeBlock
    from hp_tp import parallelize_module

    torch.manual_seed(0)
    ref = SparseMoeBlock(_config())
    xs = [torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(r + 1)) for r in range(world)]
    x = xs[rank]
    ours = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(ours, mesh, {"experts": ExpertParallel()})

    # the baseline's own storage: this rank's 1/ep of each stacked projection, flat
    n_local = EXPERTS // world
    stacked = {name: getattr(ref.experts, name).detach() for name in ("gate_proj", "up_proj", "down_proj")}
    shards = {name: w[rank * n_local:(rank + 1) * n_local].clone().requires_grad_() for name, w in stacked.items()}

    class _Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, shard: torch.Tensor) -> torch.Tensor:
            full = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
            dist.all_gather_single(full, shard.contiguous())
            return full

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
            dist.reduce_scatter_single(out, grad.contiguous())
            return out

    peak = {"allgather": 0}

    def allgather_experts(
        x: torch.Tensor, counts: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        wg, wu, wd = (_Gather.apply(shards[n]) for n in ("gate_proj", "up_proj", "down_proj"))
        peak["allgather"] = (wg.numel() + wu.numel() + wd.numel()) * 4
        outs = [F.linear(F.silu(F.linear(part, wg[e])) * F.linear(part, wu[e]), wd[e])
                for e, part in enumerate(torch.split(x[token_index], [int(c) for c in counts.tolist()]))]
        return torch.zeros_like(x).index_add(0, token_index, torch.cat(outs) * weights.unsqueeze(-1))

    baseline = copy.deepcopy(ref)
    baseline.experts.forward = allgather_experts  # type: ignore[method-assign,assignment]

    def step(block: Any) -> torch.Tensor:
        out = block(x)
        out.sum().backward()
        return out.detach()

    def one_process() -> torch.Tensor:
        out = ref(torch.cat(xs, dim=1))
        out.sum().backward()
        return out.detach()

    mine, theirs, whole = step(ours), step(baseline), one_process()
    want = whole[:, rank * tokens:(rank + 1) * tokens]
    diff = max(float((mine - want).abs().max()), float((theirs - want).abs().max()))
    times: dict[str, list[float]] = {"ours": [], "allgather": [], "one": []}
    for i in range(WARMUP + REPEATS):
        for name, fn in (("ours", lambda: step(ours)), ("allgather", lambda: step(baseline))):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:  # one process alone, every rank's tokens through every expert
            t0 = time.perf_counter()
            one_process()
            if i >= WARMUP:
                times["one"].append(time.perf_counter() - t0)
        dist.barrier()
    expert_bytes = sum(p.to_local().numel() * 4 for p in ours.experts.parameters())
    return {
        "ours": statistics.median(times["ours"]), "allgather": statistics.median(times["allgather"]),
        "one": statistics.median(times["one"]) if times["one"] else 0.0, "diff": diff,
        "ours_bytes": expert_bytes, "allgather_rest": sum(s.numel() * 4 for s in shards.values()),
        "allgather_peak": peak["allgather"], "one_bytes": sum(w.numel() * 4 for w in stacked.values()),
    }


def bench_deredundancy(rank: int, world: int, tokens: int, node: int) -> dict[str, Any]:
    """``alltoall_deredundancy`` (nodes of ``node`` ranks) against plain all-to-all on the same
    weights and tokens: step time and the bytes this rank sends to other nodes per forward +
    backward (token rows there and back, plus per copy a weight and an int64 descriptor for ours;
    the count exchange for both)."""
    import copy

    import torch
    import torch.distributed as dist

    from hp_dtensor import init_device_mesh
    from hp_ep import DeredundancyExpertParallel, ExpertParallel
    from hp_models.qwen3_5_moe import SparseMoeBlock
    from hp_tp import parallelize_module

    torch.manual_seed(0)
    ref = SparseMoeBlock(_config(DEDUP_TOP_K))
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(rank + 1))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ours, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    ours_style, plain_style = DeredundancyExpertParallel(node), ExpertParallel()
    parallelize_module(ours, mesh, {"experts": ours_style})
    parallelize_module(plain, mesh, {"experts": plain_style})

    def step(block: Any) -> torch.Tensor:
        out = block(x)
        out.sum().backward()
        return out.detach()

    diff = float((step(ours) - step(plain)).abs().max())
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for i in range(WARMUP + REPEATS):
        for name, block in (("ours", ours), ("plain", plain)):
            dist.barrier()
            t0 = time.perf_counter()
            step(block)
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    row, n_local = HIDDEN * 4, EXPERTS // world
    d = ours_style.plans[-1]
    me = rank // node
    p = plain_style.plans[-1]
    plain_rows = sum(c for g, c in enumerate(p.send_counts) if g // (node * n_local) != me)
    return {
        "ours": statistics.median(times["ours"]), "plain": statistics.median(times["plain"]), "diff": diff,
        "ours_bytes": 2 * d.cross_node_rows * row + d.cross_node_copies * 12 + 2 * (d.nodes - 1) * 8,
        "plain_bytes": 2 * plain_rows * row + n_local * (world - node) * 8,
    }


def main() -> None:
    print(f"MoE layer (hp_ep ExpertParallel), gloo ranks, {os.cpu_count()} cores; hidden {HIDDEN}, expert inter "
          f"{EXPERT_INTER}, {EXPERTS} experts, top-{TOP_K}, fp32, forward + backward, median of {REPEATS}")
    print(f"{'ep':>3} {'tok/rank':>8} {'ours s':>8} {'all-gather s':>12} {'1-proc s':>9} {'ours/ag':>8} "
          f"{'ours/1-proc':>11} {'expert MiB/rank ours':>20} {'ag rest/peak':>13} {'1-proc':>7} {'max diff':>9}")
    mib = 1 / (1 << 20)
    for world in (2, 4):
        with RankPool(world, timeout=900) as pool:
            for tokens in TOKENS:
                results = pool.run(bench, tokens)
                r = max(results, key=lambda x: x["ours"])
                one = results[0]["one"]
                print(f"{world:>3} {tokens:>8} {r['ours']:>8.4f} {r['allgather']:>12.4f} {one:>9.4f} "
                      f"{r['ours'] / r['allgather']:>8.2f} {r['ours'] / one:>11.2f} {r['ours_bytes'] * mib:>20.2f} "
                      f"{r['allgather_rest'] * mib:>6.2f}/{r['allgather_peak'] * mib:<6.2f} "
                      f"{r['one_bytes'] * mib:>7.2f} {max(x['diff'] for x in results):>9.1e}")
    world, node = 4, 2
    print(f"\nalltoall_deredundancy vs plain all-to-all, ep={world} in nodes of {node} ranks, top-{DEDUP_TOP_K} of "
          f"{EXPERTS}; bytes each rank sends to other nodes per forward + backward (summed over ranks)")
    print(f"{'tok/rank':>8} {'dedup s':>8} {'plain s':>8} {'dedup/plain':>11} {'dedup KiB':>10} {'plain KiB':>10} "
          f"{'bytes ratio':>11} {'max diff':>9}")
    with RankPool(world, timeout=900) as pool:
        for tokens in TOKENS:
            results = pool.run(bench_deredundancy, tokens, node)
            ours, plain = max(r["ours"] for r in results), max(r["plain"] for r in results)
            ob, pb = sum(r["ours_bytes"] for r in results), sum(r["plain_bytes"] for r in results)
            print(f"{tokens:>8} {ours:>8.4f} {plain:>8.4f} {ours / plain:>11.2f} {ob / 1024:>10.1f} {pb / 1024:>10.1f} "
                  f"{ob / pb:>11.2f} {max(r['diff'] for r in results):>9.1e}")


if __name__ == "__main__":
    main()
