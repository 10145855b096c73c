"""The planner's latency term, measured: what one gloo collective costs before it moves a byte.

Run: ./pants run benchmarks/redistribute_latency.py   (or python benchmarks/redistribute_latency.py)

Part 1 times all_reduce, all_gather, reduce_scatter and all_to_all on 2 gloo ranks, then on 4
(groups of 4, and pairs while the other pair runs too), over sizes from 4 B to 4 MB per rank and
fits ``t = a + b * bytes`` to each (``bytes`` is what the planner counts: bytes one rank sends
over a ring).  ``a / b`` is the latency in bytes a rank could have sent meanwhile: the planner's
``GLOO_CPU_LATENCY_BYTES`` is set from these fits (the median per world and over all are printed).

Part 2 checks the trade the term makes on a 2x2 mesh: ``[Partial(sum), Replicate()] ->
[Shard(0), Shard(0)]`` of an ``(n, 8)`` float32 tensor.  The bytes-only plan takes three steps
(a local chunk on dim 1, a reduce_scatter, an all_to_all: 3/8 of the tensor moved); the
latency-aware plan does what torch does below the crossover (one reduce_scatter and a local chunk:
1/2 moved).  Each row times both plans in the same run and prints latency-aware / bytes-only:
below 1 where the model switches to fewer collectives, about 1 where both pick the same plan.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

from dtensor_overhead import REPEATS, time_us

from hp_dtensor.testing import RankPool

SIZES = (1, 64, 1024, 16384, 262144, 1048576)  # float32 elements per rank before the collective


def _iters(numel: int) -> int:
    return max(3, min(200, 2_000_000 // max(numel, 1)))


def _collectives(rank: int, world: int) -> list[tuple[str, int, int, float]]:
    """(kind, group size, bytes sent per rank as the planner counts them, microseconds): the whole
    world as one group, and on 4 ranks also two pairs at once."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename

    groups: dict[int, Any] = {world: None}
    if world == 4:  # every rank creates every group, in the same order, and uses its own
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups[2] = pairs[rank // 2]
    rows = []
    for n, group in groups.items():
        for numel in SIZES:
            x = torch.randn(numel)
            piece = -(-numel // n)
            padded = torch.randn(piece * n)
            out_list = [torch.empty(numel) for _ in range(n)]
            scattered = torch.empty(piece)
            a2a_out = torch.empty(piece * n)
            cases = _cases(dist, group, n, numel, x, padded, out_list, scattered, a2a_out)
            for kind, (fn, elements) in cases.items():
                fn()
                rows.append((kind, n, int(elements * 4), time_us(fn, _iters(numel))))
    return rows


def _cases(dist: Any, group: Any, n: int, numel: int, x: Any, padded: Any, out_list: list[Any], scattered: Any,
           a2a_out: Any) -> dict[str, tuple[Callable[[], Any], float]]:
    """Each collective on these buffers, with the elements one rank sends as the planner counts."""
    piece = padded.numel() // n
    return {
        "all_reduce": (lambda: dist.all_reduce(x, group=group), 2 * (n - 1) / n * numel),
        "all_gather": (lambda: dist.all_gather(out_list, x, group=group), (n - 1) * numel),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(scattered, padded, group=group), (n - 1) * piece),
        "all_to_all": (lambda: dist.all_to_all_single(a2a_out, padded, group=group), (n - 1) * piece),
    }


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * bytes``: (a in us, b in us per byte)."""
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _crossover(rank: int, world: int) -> list[tuple[int, str, str, float, float]]:
    import torch

    import hp_dtensor as hp
    from hp_dtensor.platform.torch import DTensor
    from hp_dtensor.redistribute.planner import BYTES_ONLY, CostModel, plan_redistribute, set_cost_model

    mesh = hp.init_device_mesh("cpu", (2, 2))
    src = (hp.Partial("sum"), hp.Replicate())
    dst = (hp.Shard(0), hp.Shard(0))
    rows = []
    for rows_n in (16, 256, 2048, 8192, 32768, 131072):
        shape = (rows_n, 8)
        local = torch.randn(shape)
        timings = {}
        kinds = {}
        for name, model in (("latency-aware", CostModel()), ("bytes-only", BYTES_ONLY)):
            set_cost_model(model)
            kinds[name] = "+".join(plan_redistribute((2, 2), shape, src, dst).collectives())
            d = DTensor.from_local(local, mesh, list(src), shape=shape, stride=(8, 1))
            d.redistribute(mesh, list(dst))
            timings[name] = time_us(partial(d.redistribute, mesh, list(dst)), _iters(rows_n * 8))
        set_cost_model(CostModel())
        rows.append((rows_n * 8, kinds["latency-aware"], kinds["bytes-only"], timings["latency-aware"], timings["bytes-only"]))
    return rows


def main() -> None:
    from hp_dtensor.redistribute.planner import GLOO_CPU_LATENCY_BYTES

    colls = {}
    with RankPool(2, timeout=900) as pool:
        colls[2] = pool.run(_collectives)
    with RankPool(4, timeout=900) as pool:
        colls[4] = pool.run(_collectives)
        cross = pool.run(_crossover)
    print(f"# redistribute_latency: 2 and 4 gloo ranks on {os.cpu_count()} cores, median of {REPEATS} repeats")
    print(f"{'collective':<16}{'world':>6}{'group':>6}{'latency (us)':>14}{'GB/s per rank':>15}{'latency (bytes)':>17}")
    latencies: dict[int, list[float]] = {}
    for world, coll in colls.items():
        by_kind: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for i, (kind, n, nbytes, _) in enumerate(coll[0]):
            slowest = max(rows[i][3] for rows in coll)  # the slowest rank bounds the collective
            by_kind.setdefault((kind, n), []).append((nbytes, slowest))
        for (kind, n), points in by_kind.items():
            a, b = _fit(points)
            latencies.setdefault(world, []).append(a / b)
            print(f"{kind:<16}{world:>6}{n:>6}{a:>14.1f}{1e-3 / b:>15.2f}{a / b:>17.0f}")
    for world, fits in latencies.items():
        print(f"median latency on {world} ranks: {statistics.median(fits):.0f} bytes")
    every = [x for fits in latencies.values() for x in fits]
    print(f"median latency: {statistics.median(every):.0f} bytes (planner constant: {GLOO_CPU_LATENCY_BYTES:.0f})")
    print()
    print(f"{'elements':>10}  {'latency-aware plan':<30}{'bytes-only plan':<34}{'aware (us)':>11}{'bytes (us)':>11}{'ratio':>7}")
    for r in range(len(cross[0])):
        numel, k_aware, k_bytes, _, _ = cross[0][r]
        t_aware = max(c[r][3] for c in cross)
        t_bytes = max(c[r][4] for c in cross)
        print(f"{numel:>10}  {k_aware:<30}{k_bytes:<34}{t_aware:>11.1f}{t_bytes:>11.1f}{t_aware / t_bytes:>7.2f}")


if __name__ == "__main__":
    main()
