"""Pipeline parallelism (hp_pp) against torch.distributed.pipelining, same run, pp=2 gloo ranks.

Both run the same Qwen3.5 split (the same stage modules, built from one seed) under the same
schedule: GPipe and 1F1B (one stage per rank) and Interleaved1F1B (two chunks per rank).  Three
runners per schedule: ours as configured by default (``overlap_p2p``: each receive posted before
the compute that precedes it), ours with receives posted only when the plan reaches them, and
torch's.  Each repeat steps all three back to back between barriers, in an order that rotates
every repeat, so load from other processes on the machine hits them alike; the ratio printed is
the median over repeats of the per-repeat ratio ours / torch (target <= 1.0), and the step times
are medians.

Where the time goes, per rank (medians over repeats): ``compute`` is the forward, loss and
backward of every microbatch, ``wait`` the time blocked on a transfer, ``other`` the rest of the
step (runner bookkeeping, posting transfers, and the slower rank's tail).  Ours counts them
itself (``schedule.last_step``); torch's are measured by wrapping its stage's
``forward_one_chunk`` / ``backward_one_chunk``, its schedule's loss computation and its P2P
wait.  The measured bubble is ``1 - compute / step`` averaged over the ranks, beside the textbook
``(pp - 1) / (m * chunks + pp - 1)`` and the plan's own under unit-cost compute (F 1, B 2).

Run: ./pants run benchmarks/pp.py   (or python benchmarks/pp.py [repeats])
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from hp_dtensor.testing import RankPool

LAYERS, BATCH, SEQ, MICROBATCHES = 8, 16, 64, 8
REPEATS, WARMUP = 9, 2
CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))
RUNNERS = ("ours", "ours_at_need", "torch")


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class _Timed:
    """Seconds spent in the wrapped callables since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def bench(rank: int, world: int, kind: str, interleave: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tpp
    from torch.distributed.pipelining import schedules as tsched

    from hp_dtensor import init_device_mesh
    from hp_models import synthetic
    from hp_models.qwen3_5 import pipeline_qwen3_5, split_qwen3_5, tiny_config
    from hp_pp import ScheduleKind, schedule_for, split_layers

    cfg = tiny_config(num_hidden_layers=LAYERS)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    split = split_layers("auto", LAYERS, world, interleave)
    nv = split.num_virtual
    sk = ScheduleKind(kind)
    ids, tgt = synthetic.batch(0, 0, BATCH, SEQ, cfg.vocab_size)

    def fresh() -> Any:
        torch.manual_seed(0)
        full = cfg.build()
        full.init_weights()
        return full

    ours_cls: Any = schedule_for(sk)  # one stage, or the list of them when interleaved
    ours: dict[str, Any] = {}
    for name, overlap in (("ours", True), ("ours_at_need", False)):
        stages = pipeline_qwen3_5(fresh(), split, mesh)
        ours[name] = (ours_cls(stages if sk.interleaved else stages[0], MICROBATCHES, _loss, overlap_p2p=overlap),
                      [s.module for s in stages])

    # torch's schedule, its compute and its P2P waits timed by wrapping them
    compute, wait = _Timed(), _Timed()
    chunks = split_qwen3_5(fresh(), split, rank)
    tstages = [tpp.PipelineStage(c, v, nv, torch.device("cpu"), group=mesh.get_group(0))
               for c, v in zip(chunks, split.stages_of(rank))]
    for s in tstages:
        s.forward_one_chunk = compute.wrap(s.forward_one_chunk)  # type: ignore[method-assign]
        s.backward_one_chunk = compute.wrap(s.backward_one_chunk)  # type: ignore[method-assign]
    tcls = {ScheduleKind.GPIPE: tpp.ScheduleGPipe, ScheduleKind.ONE_F_ONE_B: tpp.Schedule1F1B,
            ScheduleKind.INTERLEAVED_1F1B: tpp.ScheduleInterleaved1F1B}[sk]
    theirs: Any = tcls(tstages if sk.interleaved else tstages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    theirs._maybe_compute_loss = compute.wrap(theirs._maybe_compute_loss)
    real_wait = tsched._wait_batch_p2p
    tsched._wait_batch_p2p = wait.wrap(real_wait)

    first, last = 0 in split.stages_of(rank), nv - 1 in split.stages_of(rank)
    args = [ids] if first else []
    target = tgt if last else None

    def step(name: str) -> tuple[float, float]:
        """(compute, wait) seconds of one step of runner ``name`` on this rank."""
        if name == "torch":
            for c in chunks:
                c.zero_grad(set_to_none=False)
            compute.seconds = wait.seconds = 0.0
            theirs.step(*args, target=target)
            return compute.seconds, wait.seconds
        sched, modules = ours[name]
        for mod in modules:
            mod.zero_grad(set_to_none=False)
        sched.step(*args, target=target)
        return sched.last_step.compute_s, sched.last_step.wait_s

    out: dict[str, dict[str, list[float]]] = {n: {"step": [], "compute": [], "wait": []} for n in RUNNERS}
    try:
        for i in range(WARMUP + repeats):
            order = RUNNERS[i % 3:] + RUNNERS[:i % 3]
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                busy, blocked = step(name)
                dist.barrier()  # a step ends when the slowest rank is done
                if i >= WARMUP:
                    out[name]["step"].append(time.perf_counter() - t0)
                    out[name]["compute"].append(busy)
                    out[name]["wait"].append(blocked)
    finally:
        tsched._wait_batch_p2p = real_wait
    return out


def main() -> None:
    from hp_pp import ScheduleKind, build_plan, simulate, theoretical_bubble

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else REPEATS
    world = 2
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"pipeline parallel, pp={world} gloo ranks, {os.cpu_count()} cores (load average {load}); Qwen3.5 tiny "
          f"config, {LAYERS} layers, batch {BATCH} x seq {SEQ}, {MICROBATCHES} microbatches, fp32, "
          f"{repeats} repeats")
    with RankPool(world, timeout=1800) as pool:
        for kind, interleave in CASES:
            res = pool.run(bench, kind, interleave, repeats)
            sk = ScheduleKind(kind)
            name = f"{kind} x{interleave}" if interleave > 1 else kind
            steps = {n: res[0][n]["step"] for n in RUNNERS}  # the same on both ranks, up to the barrier
            theory = theoretical_bubble(sk, world, MICROBATCHES, interleave)
            plan = simulate(build_plan(sk, world, MICROBATCHES, world * interleave)).bubble_fraction
            torch_med = statistics.median(steps["torch"])
            print(f"\n{name}: theoretical bubble {theory:.3f} (plan under F1/B2: {plan:.3f})")
            print(f"  {'runner':>13} {'step s':>7} {'/torch':>7} {'bubble':>7}   per rank: compute / wait / other s")
            for n in RUNNERS:
                ratio = statistics.median(a / b for a, b in zip(steps[n], steps["torch"]))
                step = statistics.median(steps[n])
                parts = []
                for r in range(world):
                    rows = list(zip(steps[n], res[r][n]["compute"], res[r][n]["wait"]))
                    c = statistics.median(row[1] for row in rows)
                    w = statistics.median(row[2] for row in rows)
                    o = statistics.median(row[0] - row[1] - row[2] for row in rows)
                    parts.append(f"{c:.3f} / {w:.3f} / {o:.3f}")
                # per repeat: the ranks' mean idle share of the step
                bubble = statistics.median(
                    1 - statistics.mean(res[r][n]["compute"][i] for r in range(world)) / steps[n][i]
                    for i in range(len(steps[n])))
                rel = f"{ratio:>7.3f}" if n != "torch" else f"{step / torch_med:>7.3f}"
                print(f"  {n:>13} {step:>7.4f} {rel} {bubble:>7.3f}   " + " | ".join(parts))

if __name__ == "__main__":
    main()
