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
REPEATS, WARMUP = 5, 1


def _config() -> Any:
    from hp_models.qwen3_5_moe import tiny_moe_config

    return tiny_moe_config(hidden_size=HIDDEN, moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, shared_expert_intermediate_size=HIDDEN)


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

    def allgather_experts(xe: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        wg, wu, wd = (_Gather.apply(shards[n]) for n in ("gate_proj", "up_proj", "down_proj"))
        peak["allgather"] = (wg.numel() + wu.numel() + wd.numel()) * 4
        outs = [F.linear(F.silu(F.linear(part, wg[e])) * F.linear(part, wu[e]), wd[e])
                for e, part in enumerate(torch.split(xe, [int(c) for c in counts.tolist()]))]
        return torch.cat(outs)

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


if __name__ == "__main__":
    main()
