"""MindSpore backend on 2 CPU ranks, measured in one run:

1. start-up: seconds until 2 MindSpore ranks (scheduler + workers) answer, vs 2 torch gloo ranks;
2. collectives on 1 MiB fp32: mccl's native AllReduce/AllGather and the composed reduce_scatter /
   all_to_all (CPU mccl has neither), each against gloo's native one;
3. a Colwise+Rowwise MLP forward+backward at tp=2: hyper-parallel's styles vs a hand-written
   Megatron-style MindSpore MLP (local Dense shards, one raw AllReduce forward, one backward).

Run: ./pants run benchmarks/ms_tp_mlp.py   (or HYPER_PARALLEL_PLATFORM=mindspore python benchmarks/ms_tp_mlp.py)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from hp_dtensor.testing import RankPool

SIZES = [(1024, 4096, 512), (256, 1024, 32)]  # hidden, ffn, tokens
REPEATS = 9
MIB = 1 << 20


def median_ms(fn: Any, repeats: int = REPEATS) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after one warm-up call (also used by
    ms_fsdp.py)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ms_collectives(rank: int, world: int) -> dict[str, float]:
    from mindspore import Tensor

    from hp_dtensor import init_device_mesh
    from hp_dtensor.platform.mindspore import collectives as C

    mesh = init_device_mesh("cpu", (world,))
    g = mesh.get_group(0)
    x = Tensor(np.ones((MIB // 4 // 256, 256), np.float32))
    return {
        "all_reduce": median_ms(lambda: C.all_reduce(x, "sum", g, world, rank).asnumpy()),
        "all_gather": median_ms(lambda: C.all_gather(x, 0, g, world, rank).asnumpy()),
        "reduce_scatter": median_ms(lambda: C.reduce_scatter(x, 0, "sum", g, world, rank).asnumpy()),
        "all_to_all": median_ms(lambda: C.all_to_all(x, 1, 0, g, world, rank).asnumpy()),
    }


def _torch_collectives(rank: int, world: int) -> dict[str, float]:
    import torch

    from hp_dtensor import init_device_mesh
    from hp_dtensor.platform.torch import collectives as C

    mesh = init_device_mesh("cpu", (world,))
    g = mesh.get_group(0)
    x = torch.ones(MIB // 4 // 256, 256)
    return {
        "all_reduce": median_ms(lambda: C.all_reduce(x, "sum", g, world)),
        "all_gather": median_ms(lambda: C.all_gather(x, 0, g, world)),
        "reduce_scatter": median_ms(lambda: C.reduce_scatter(x, 0, "sum", g, world)),
        "all_to_all": median_ms(lambda: C.all_to_all(x, 1, 0, g, world)),
    }


def _mlp(rank: int, world: int, hidden: int, ffn: int, tokens: int) -> dict[str, float]:
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import GlobalComm

    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module

    rs = np.random.RandomState(0)
    w1 = (rs.randn(ffn, hidden) * 0.02).astype(np.float32)
    w2 = (rs.randn(hidden, ffn) * 0.02).astype(np.float32)
    x = Tensor(rs.randn(tokens, hidden).astype(np.float32))

    class MLP(nn.Cell):
        def __init__(self, a: np.ndarray, b: np.ndarray) -> None:
            super().__init__()
            self.up = nn.Dense(a.shape[1], a.shape[0], has_bias=False)
            self.down = nn.Dense(b.shape[1], b.shape[0], has_bias=False)
            self.up.weight.set_data(Tensor(a))
            self.down.weight.set_data(Tensor(b))

        def construct(self, h: Any) -> Any:
            return self.down(ops.relu(self.up(h)))

    def step_of(cell: Any) -> Any:
        params = cell.trainable_params()
        grad = ms.value_and_grad(lambda h: cell(h).sum(), None, params)
        return lambda: grad(x)[0].asnumpy()

    ours = parallelize_module(MLP(w1, w2), init_device_mesh("cpu", (world,)),
                              {"up": ColwiseParallel(), "down": RowwiseParallel()})
    world_group = GlobalComm.WORLD_COMM_GROUP

    class Reduce(ms._Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, t: Any) -> Any:
            return ops.AllReduce(group=world_group)(t)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    class Copy(ms._Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, t: Any) -> Any:
            return t

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return ops.AllReduce(group=world_group)(g)

    class Megatron(MLP):
        def construct(self, h: Any) -> Any:
            return Reduce.apply(self.down(ops.relu(self.up(Copy.apply(h)))))

    hand = Megatron(np.split(w1, world, 0)[rank], np.split(w2, world, 1)[rank])
    return {"ours": median_ms(step_of(ours)), "hand": median_ms(step_of(hand))}


def main() -> None:
    ms_env = {"HYPER_PARALLEL_PLATFORM": "mindspore"}
    print(f"MindSpore backend, 2 ranks on {os.cpu_count()} cores, median of {REPEATS}")
    t0 = time.perf_counter()
    ms_pool = RankPool(2, env=ms_env, timeout=600)
    ms_pool.start()
    ms_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch_pool = RankPool(2, env={"HYPER_PARALLEL_PLATFORM": "torch"}, timeout=600)
    torch_pool.start()
    torch_start = time.perf_counter() - t0
    print(f"\nstart-up (s)     mindspore {ms_start:6.1f}   torch/gloo {torch_start:6.1f}   "
          f"ratio {ms_start / torch_start:5.1f}")
    try:
        msc = ms_pool.run(_ms_collectives)[0]
        tc = torch_pool.run(_torch_collectives)[0]
        print(f"\n{'1 MiB fp32':18}{'mccl (ms)':>11}{'gloo (ms)':>11}{'mccl/gloo':>11}  how")
        how = {"all_reduce": "native", "all_gather": "native (world group)",
               "reduce_scatter": "composed: AllReduce + chunk", "all_to_all": "composed: AllGather + chunk"}
        for k in msc:
            print(f"{k:18}{msc[k]:11.2f}{tc[k]:11.2f}{msc[k] / tc[k]:11.2f}  {how[k]}")
        print(f"\n{'MLP fwd+bwd tp=2':34}{'ours (ms)':>11}{'hand (ms)':>11}{'ours/hand':>11}")
        for hidden, ffn, tokens in SIZES:
            r = ms_pool.run(_mlp, hidden, ffn, tokens, timeout=600)[0]
            label = f"h={hidden} ffn={ffn} tokens={tokens}"
            print(f"{label:34}{r['ours']:11.2f}{r['hand']:11.2f}{r['ours'] / r['hand']:11.2f}")
    finally:
        ms_pool.close()
        torch_pool.close()


if __name__ == "__main__":
    main()
