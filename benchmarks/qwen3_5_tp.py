"""Qwen3.5 tiny forward+backward step at tp=2 (2 gloo ranks, one thread each) against the
unsharded model in one process with the same total threads, same weights, same batch.

Rows, all measured in the same run (the tp rows interleaved so machine noise hits them alike):
hyper-parallel's plan with sequence parallelism (the default, what the main job runs) and without
it, and the hand-written Megatron-style tp=2 model of ``qwen3_5_megatron`` (local shards, raw
collectives, no DTensor) with and without sequence parallelism: the limit for each plan.  Loss
parallel everywhere.  Before timing, every tp row's loss and whole gradients are checked against
the unsharded model.  Collectives per step are counted (``CommDebugMode`` for ours, the
hand-written model's own counter).  Ours leaves the gradients of norm weights that are per-rank
parts ``Partial`` (all norms with SP; the gated and q/k norms without), reduced when the trainer
takes the gradient norm; the hand-written rows reduce theirs in one bucket, counted and timed.

torch.distributed.tensor.parallel has no style for the linear-attention layers' head-sharded
depthwise convs and per-head parameters (its plan for this model gathers them, see the HF
``colwise_gather_output`` entries), so no torch column is printed for the whole model.

Run: ./pants run benchmarks/qwen3_5_tp.py   (or python benchmarks/qwen3_5_tp.py)
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from hp_dtensor.testing import RankPool

REPEATS = 9
BATCH, SEQ = 8, 128
ROWS = [
    ("hand", "hand-written tp=2, no SP"),
    ("hand_sp", "hand-written tp=2, SP"),
    ("ours_nosp", "hyper-parallel tp=2, no SP"),
    ("ours_sp", "hyper-parallel tp=2, SP (default)"),
]


def _model_and_batch() -> tuple[Any, Any, Any]:
    import torch

    from hp_models.qwen3_5 import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config()
    model = cfg.build()
    model.init_weights()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    tgt = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    return model, ids, tgt


def _time(steps: dict[str, Callable[[], Any]], barrier: Callable[[], None]) -> dict[str, float]:
    """Median ms per step of each, interleaved over ``REPEATS`` rounds after two warm-up steps."""
    for fn in steps.values():
        for _ in range(2):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(REPEATS):
        for name, fn in steps.items():
            barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def _unsharded(rank: int, world: int) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count() or 1)  # the same total threads as the tp ranks together
    model, ids, tgt = _model_and_batch()

    def step() -> None:
        model.zero_grad()
        F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()

    return _time({"one": step}, lambda: None)["one"]


def _tp(rank: int, world: int) -> dict[str, tuple[float, int]]:
    import qwen3_5_megatron as mg
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp
    from hp_tp import loss_parallel

    ref, ids, tgt = _model_and_batch()
    mesh = init_device_mesh("cpu", (world,))
    ours = {sp: parallelize_qwen3_5_tp(copy.deepcopy(ref), mesh, sequence_parallel=sp) for sp in (False, True)}
    hand = {sp: mg.MegatronQwen3_5(ref, rank, world, sp=sp) for sp in (False, True)}

    def ours_step(sp: bool) -> Callable[[], Any]:
        def step() -> Any:
            ours[sp].zero_grad()
            logits = ours[sp](ids)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
                loss.backward()
            return loss
        return step

    def hand_step(sp: bool) -> Callable[[], Any]:
        def step() -> Any:
            hand[sp].model.zero_grad()
            loss = hand[sp].loss(ids, tgt)
            loss.backward()
            hand[sp].finish_grads()
            return loss
        return step

    steps = {"hand": hand_step(False), "hand_sp": hand_step(True), "ours_nosp": ours_step(False),
             "ours_sp": ours_step(True)}

    # Every row equals the unsharded model (loss and whole gradients) before it is timed.
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten())
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    counts = {}
    for name, fn in steps.items():
        mg.COUNT[0] = 0
        with CommDebugMode() as comm:
            loss = fn()
        if name.startswith("ours"):
            counts[name] = comm.get_total_counts()
            grads = {n: p.grad.full_tensor() for n, p in ours[name == "ours_sp"].named_parameters()}
            loss = loss.full_tensor()
        else:
            counts[name] = mg.COUNT[0]
            grads = hand[name == "hand_sp"].full_grads()
        torch.testing.assert_close(loss, ref_loss, rtol=1.5e-4, atol=1e-5, msg=f"{name}: loss differs")
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-3, atol=1e-5, msg=f"{name}: {n} grad differs")
    med = _time(steps, dist.barrier)
    return {k: (med[k], counts[k]) for k in steps}


def main() -> None:
    with RankPool(1, timeout=900) as pool:
        single = pool.run(_unsharded, timeout=900)[0]
    with RankPool(2, timeout=900) as pool:
        per_rank = pool.run(_tp, timeout=900)
    print(f"# qwen3_5_tp: tiny config, batch {BATCH} x seq {SEQ}, fwd+bwd step with loss parallel, "
          f"{os.cpu_count()} cores, median of {REPEATS} (ms); load average {os.getloadavg()[0]:.2f}")
    print(f"{'setup':<38}{'ms/step':>10}{'ratio':>8}{'collectives':>13}")
    print(f"{'one process, ' + str(os.cpu_count()) + ' threads':<38}{single:>10.1f}{1.0:>8.2f}{0:>13}")
    for key, label in ROWS:
        ms = max(r[key][0] for r in per_rank)  # the slower rank sets the step
        print(f"{label:<38}{ms:>10.1f}{ms / single:>8.2f}{per_rank[0][key][1]:>13}")
    print("torch.distributed.tensor.parallel: no equivalent plan for the linear-attention layers (see docstring)")


if __name__ == "__main__":
    main()
