"""Per-op overhead of hp_dtensor's DTensor against torch.distributed.tensor, same run, 2 gloo ranks.

Run: ./pants run benchmarks/dtensor_overhead.py   (or python benchmarks/dtensor_overhead.py)
Prints microseconds per call (median of repeats) and the ratio ours/torch per row.  The last row
is a steady-state TP block forward (a small SwiGLU MLP, Colwise gate/up and Rowwise down, hp_tp
against torch's parallelize_module on the same weights): every op in it is a cached decision, so
the row shows per-op costs end to end.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from tp_mlp import build_swiglu

from hp_dtensor.testing import RankPool

REPEATS = 7


def time_us(fn: Callable[[], Any], iters: int) -> float:
    """Microseconds per call of ``fn``: the median of ``REPEATS`` timed loops, each started
    together on every rank (a barrier) so that collectives inside ``fn`` meet."""
    import torch.distributed as dist

    samples = []
    for _ in range(REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def _settle(out: Any) -> Any:
    """The block's output with its collective finished: torch's Rowwise output may be an async
    collective tensor, which would otherwise leave its all_reduce out of the timing."""
    wait = getattr(out, "wait", None)
    return wait() if callable(wait) else out


def _parallelize(module: Any, mesh: Any, lib: str) -> Any:
    if lib == "ours":
        from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module
    else:
        from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    return parallelize_module(module, mesh, plan)  # type: ignore[arg-type]


def _bench(rank: int, world: int) -> list[tuple[str, float, float]]:
    import torch
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import hp_dtensor as hp
    from hp_dtensor.platform.torch import DTensor as HpDTensor

    torch.manual_seed(0)
    ours_mesh = hp.init_device_mesh("cpu", (world,))
    theirs_mesh = torch_mesh("cpu", (world,))
    x = torch.randn(64, 64)
    big = torch.randn(1024 * 1024 // 4 // world * world)  # 1 MiB of fp32
    w = torch.randn(256, 256)
    act = torch.randn(8, 16, 256)

    block = build_swiglu(256, 512)
    block_in = torch.randn(4, 8, 256)

    def make(lib: str) -> dict[str, Callable[[], Any]]:
        mesh: Any
        R: Any
        S: Any
        dist_t: Any
        from_local: Any
        if lib == "ours":
            mesh, R, S, dist_t, from_local = ours_mesh, hp.Replicate, hp.Shard, hp.distribute_tensor, HpDTensor.from_local
        else:
            mesh, R, S, dist_t, from_local = theirs_mesh, tdt.Replicate, tdt.Shard, tdt.distribute_tensor, tdt.DTensor.from_local
        a_rep, b_rep = dist_t(x, mesh, [R()]), dist_t(x, mesh, [R()])
        a_sh, b_sh = dist_t(x, mesh, [S(0)]), dist_t(x, mesh, [S(0)])
        local = x.chunk(world)[rank].contiguous()
        big_sh = dist_t(big, mesh, [S(0)])
        w_col = dist_t(w, mesh, [S(0)])
        act_rep = dist_t(act, mesh, [R()])
        tp_block = _parallelize(copy.deepcopy(block), mesh, lib)
        return {
            "Replicate add": lambda: a_rep + b_rep,
            "Shard(0) add": lambda: a_sh + b_sh,
            "from_local": lambda: from_local(local, mesh, [S(0)]),
            "to_local": lambda: a_sh.to_local(),
            "Shard->Replicate 1 MiB": lambda: big_sh.redistribute(mesh, [R()]),
            "linear fwd h=256": lambda: torch.nn.functional.linear(act_rep, w_col),
            "TP MLP block fwd h=256": lambda: _settle(tp_block(block_in)),
        }

    ours, theirs = make("ours"), make("torch")
    rows = []
    with torch.no_grad():
        for name in ours:
            iters = 20 if "MiB" in name or "linear" in name or "block" in name else 300
            for fn in (ours[name], theirs[name]):  # warm caches (sharding decisions, plans)
                for _ in range(5):
                    fn()
            t_ours = time_us(ours[name], iters)
            t_theirs = time_us(theirs[name], iters)
            rows.append((name, t_ours, t_theirs))
    return rows


def main() -> None:
    with RankPool(2, timeout=600) as pool:
        rows = pool.run(_bench)[0]
    print(f"# dtensor_overhead: 2 gloo ranks on {os.cpu_count()} cores, median of {REPEATS} repeats")
    print(f"{'op':<26}{'ours (us)':>12}{'torch (us)':>12}{'ours/torch':>12}")
    for name, ours, theirs in rows:
        print(f"{name:<26}{ours:>12.1f}{theirs:>12.1f}{ours / theirs:>12.2f}")


if __name__ == "__main__":
    main()
