"""Qwen3.5 tiny forward+backward step: hyper-parallel tp=2 (2 gloo ranks, sequence + loss
parallel) against the unsharded model in one process, same weights, same batch.

torch.distributed.tensor.parallel has no style for the linear-attention layers' head-sharded
depthwise convs and per-head parameters (its plan for this model gathers them, see the HF
``colwise_gather_output`` entries), so no torch column is printed for the whole model.

Run: ./pants run benchmarks/qwen3_5_tp.py   (or python benchmarks/qwen3_5_tp.py)
"""

from __future__ import annotations

import os
import statistics
import time

from hp_dtensor.testing import RankPool

REPEATS = 7
BATCH, SEQ = 8, 128


def _step_time(rank: int, world: int, sharded: bool) -> float:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp, tiny_config
    from hp_tp import loss_parallel

    torch.manual_seed(0)
    cfg = tiny_config()
    model = cfg.build()
    model.init_weights()
    if sharded:
        parallelize_qwen3_5_tp(model, init_device_mesh("cpu", (world,)))
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    tgt = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))

    def step() -> None:
        model.zero_grad()
        logits = model(ids)
        if sharded:
            with loss_parallel():
                F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()
        else:
            F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()

    for _ in range(2):
        step()
    samples = []
    for _ in range(REPEATS):
        if sharded:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _unsharded(rank: int, world: int) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # the unsharded baseline gets the whole machine
    return _step_time(rank, world, False)


def main() -> None:
    with RankPool(1, timeout=900) as pool:
        single = pool.run(_unsharded, timeout=900)[0]
    with RankPool(2, timeout=900) as pool:
        tp2 = max(pool.run(_step_time, True, timeout=900))
    print(f"# qwen3_5_tp: tiny config, batch {BATCH} x seq {SEQ}, fwd+bwd step, {os.cpu_count()} cores, "
          f"median of {REPEATS} (ms)")
    print(f"{'setup':<34}{'ms/step':>10}{'ratio':>8}")
    print(f"{'unsharded (1 process, all cores)':<34}{single:>10.1f}{1.0:>8.2f}")
    print(f"{'hyper-parallel tp=2 (2 ranks)':<34}{tp2:>10.1f}{tp2 / single:>8.2f}")
    print("torch.distributed.tensor.parallel: no equivalent plan for the linear-attention layers (see docstring)")


if __name__ == "__main__":
    main()
