"""Pipeline parallelism (hp_pp) against torch.distributed.pipelining, same run, pp=2 gloo ranks.

Both run the same Qwen3.5 split (the same stage modules, built from one seed) under the same
schedule: GPipe and 1F1B (one stage per rank) and Interleaved1F1B (two chunks per rank).  Printed
per schedule: the step time of each (forward + backward of every microbatch; median of repeated
steps after warm-up, ours and torch's alternating so machine noise hits both alike), the ratio
ours/torch (target <= 1.0), and the measured bubble fraction against the schedule's theoretical
one (``overlap`` rows: ours with ``overlap_p2p``, which posts the next receive ahead; torch's
schedules always post theirs ahead).  The measured bubble is ``1 - busy / step``: ``busy`` is the same rank's forward and
backward of the same microbatches run back to back with no communication, so it also counts any
time the runner itself adds.  The theoretical one is the textbook ``(pp - 1) / (m * chunks +
pp - 1)``, and the plan's own under unit-cost compute (F 1, B 2) is printed beside it.

Run: ./pants run benchmarks/pp.py   (or python benchmarks/pp.py)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from hp_dtensor.testing import RankPool

LAYERS, BATCH, SEQ, MICROBATCHES = 8, 16, 64, 8
REPEATS, WARMUP = 5, 2
# (schedule, interleave, ours with overlap_p2p: receives posted ahead)
CASES = (("gpipe", 1, False), ("1f1b", 1, False), ("interleaved_1f1b", 2, False), ("interleaved_1f1b", 2, True))


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def bench(rank: int, world: int, kind: str, interleave: int, overlap: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tpp

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

    stages = pipeline_qwen3_5(fresh(), split, mesh)
    ours_cls: Any = schedule_for(sk)  # one stage, or the list of them when interleaved
    ours = ours_cls(stages if sk.interleaved else stages[0], MICROBATCHES, _loss, overlap_p2p=overlap)
    chunks = split_qwen3_5(fresh(), split, rank)
    tstages = [tpp.PipelineStage(c, v, nv, torch.device("cpu"), group=mesh.get_group(0))
               for c, v in zip(chunks, split.stages_of(rank))]
    tcls = {ScheduleKind.GPIPE: tpp.ScheduleGPipe, ScheduleKind.ONE_F_ONE_B: tpp.Schedule1F1B,
            ScheduleKind.INTERLEAVED_1F1B: tpp.ScheduleInterleaved1F1B}[sk]
    theirs = tcls(tstages if sk.interleaved else tstages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    first, last = 0 in split.stages_of(rank), nv - 1 in split.stages_of(rank)
    args = [ids] if first else []
    target = tgt if last else None

    def step_ours() -> None:
        for s in stages:
            s.module.zero_grad(set_to_none=False)
        ours.step(*args, target=target)

    def step_torch() -> None:
        for c in chunks:
            c.zero_grad(set_to_none=False)
        theirs.step(*args, target=target)

    def busy() -> None:
        """This rank's forwards and backwards of every microbatch, no communication."""
        mbs = ids.tensor_split(MICROBATCHES)
        tgts = tgt.tensor_split(MICROBATCHES)
        hidden = torch.zeros(BATCH // MICROBATCHES, SEQ, cfg.hidden_size)
        for c in chunks:
            for i in range(MICROBATCHES):
                x = mbs[i] if c.first else hidden.clone().requires_grad_(True)
                out = c(x)
                if c.last:
                    (_loss(out, tgts[i]) / MICROBATCHES).backward()
                else:
                    out.backward(torch.ones_like(out))

    times: dict[str, list[float]] = {"ours": [], "torch": [], "busy": []}
    for i in range(WARMUP + REPEATS):
        for name, fn in (("ours", step_ours), ("torch", step_torch), ("busy", busy)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if name != "busy":
                dist.barrier()  # a step ends when the slowest rank is done
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    from hp_pp import ScheduleKind, build_plan, simulate, theoretical_bubble

    world = 2
    print(f"pipeline parallel, pp={world} gloo ranks, {os.cpu_count()} cores; Qwen3.5 tiny config, {LAYERS} layers, "
          f"batch {BATCH} x seq {SEQ}, {MICROBATCHES} microbatches, fp32, median of {REPEATS} steps")
    print(f"{'schedule':>22} {'ours s':>8} {'torch s':>8} {'ours/torch':>10} {'bubble ours':>12} "
          f"{'bubble torch':>13} {'theory':>7} {'plan F1/B2':>11}")
    with RankPool(world, timeout=900) as pool:
        for kind, interleave, overlap in CASES:
            res = pool.run(bench, kind, interleave, overlap)
            ours = max(r["ours"] for r in res)
            theirs = max(r["torch"] for r in res)
            busy = statistics.mean(r["busy"] for r in res)
            sk = ScheduleKind(kind)
            theory = theoretical_bubble(sk, world, MICROBATCHES, interleave)
            plan = simulate(build_plan(sk, world, MICROBATCHES, world * interleave)).bubble_fraction
            name = (f"{kind} x{interleave}" if interleave > 1 else kind) + (" overlap" if overlap else "")
            print(f"{name:>22} {ours:>8.4f} {theirs:>8.4f} {ours / theirs:>10.2f} {1 - busy / ours:>12.2f} "
                  f"{1 - busy / theirs:>13.2f} {theory:>7.2f} {plan:>11.2f}")


if __name__ == "__main__":
    main()
