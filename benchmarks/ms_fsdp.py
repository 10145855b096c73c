"""``fully_shard`` on MindSpore, 2 CPU ranks, measured in one run against two baselines:

1. one-process MindSpore on the whole batch (what FSDP must not be much slower than on the same
   cores; MindSpore sizes its own CPU thread pool in every process);
2. our torch path: the same model and batch split under ``fully_shard`` on 2 gloo ranks.

The model is a stack of pre-norm MLP blocks (LayerNorm, Dense d -> 4d, tanh, Dense 4d -> d,
residual), each block its own FSDP group and the root another; a step is the forward, the loss
and the backward (the gathers before forward, and on torch again before backward, and the
gradients' reduce-scatter), not the optimizer, which FSDP does not change.  Printed per size:
median step times, the ratios ours-on-MindSpore / one-process MindSpore and / ours-on-torch, and
the parameter bytes each rank holds against the whole model's.  Timings are medians of REPEATS
after a warm-up; the three runners are measured in turn, so load from other processes on the
machine hits them alike.

MindSpore runs in two modes, each in its own pair of rank processes (the mode is process-wide):
``async``, PyNative's default, where each op is queued to runtime threads and the Python thread
waits whenever it needs a result or a collective; and ``blocking`` (``mindspore.runtime.
launch_blocking()``, what the MindSpore backend's ``set_num_threads`` sets in every rank of a
rank pool), where each op runs before the call returns, as torch's CPU ops do.  FSDP's
collectives drain the asynchronous queue several times a step, so the two modes separate what
fully_shard costs from what the queue costs on a busy machine.

Run: ./pants run benchmarks/ms_fsdp.py   (or HYPER_PARALLEL_PLATFORM=mindspore python benchmarks/ms_fsdp.py)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from ms_tp_mlp import median_ms

from hp_dtensor.testing import RankPool

SIZES = [(256, 4, 64), (512, 4, 256)]  # hidden, blocks, tokens (whole batch)
REPEATS = 7


def _data(d: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1)
    return rng.randn(tokens, d).astype(np.float32), rng.randn(tokens, d).astype(np.float32)


def _ms_net(d: int, blocks: int) -> Any:
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm((d,))
            self.up = nn.Dense(d, 4 * d)
            self.down = nn.Dense(4 * d, d)

        def construct(self, x: Any) -> Any:
            return x + self.down(ops.tanh(self.up(self.norm(x))))

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.CellList([Block() for _ in range(blocks)])

        def construct(self, x: Any) -> Any:
            for b in self.blocks:
                x = b(x)
            return x

    net = Net()
    rng = np.random.RandomState(0)
    for _, p in sorted(net.parameters_and_names(), key=lambda kv: kv[0]):
        p.set_data(ms.Tensor((rng.randn(*p.shape) * 0.02).astype(np.float32)))
    return net


def _ms_step_fn(net: Any, x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    import mindspore as ms
    from mindspore import ops

    weights = net.trainable_params()
    grad_fn = ms.value_and_grad(lambda xb, yb: ops.mean((net(xb) - yb) ** 2), None, weights)
    xt, yt = ms.Tensor(x), ms.Tensor(y)

    def step() -> None:
        loss, grads = grad_fn(xt, yt)
        loss.asnumpy()  # PyNative runs asynchronously: wait for the step's work
        for g in grads:
            g.asnumpy()

    return step


def _local_bytes(params: Any) -> int:
    from hp_dtensor import DTensor

    return sum(int(np.prod((p.to_local() if isinstance(p, DTensor) else p).shape)) * 4 for p in params)


def _ms_single(rank: int, world: int, d: int, blocks: int, tokens: int) -> dict[str, float]:
    """Rank 0 only: one-process MindSpore on the whole batch (the other rank waits)."""
    if rank != 0:
        return {}
    net = _ms_net(d, blocks)
    x, y = _data(d, tokens)
    return {"ms": median_ms(_ms_step_fn(net, x, y), REPEATS), "bytes": _local_bytes(net.trainable_params())}


def _ms_fsdp(rank: int, world: int, d: int, blocks: int, tokens: int) -> dict[str, float]:
    from hp_dtensor import init_device_mesh
    from hp_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    net = _ms_net(d, blocks)
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x, y = _data(d, tokens)
    rows = np.array_split(np.arange(tokens), world)[rank]
    step_ms = median_ms(_ms_step_fn(net, x[rows], y[rows]), REPEATS)
    return {"ms_fsdp": step_ms, "bytes": _local_bytes(net.trainable_params())}


def _torch_fsdp(rank: int, world: int, d: int, blocks: int, tokens: int) -> dict[str, float]:
    import torch
    from torch import nn

    from hp_dtensor import init_device_mesh
    from hp_fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.tanh(self.up(self.norm(x))))

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = nn.Sequential(*[Block() for _ in range(blocks)])
    for b in net:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x, y = (torch.from_numpy(a) for a in _data(d, tokens))
    rows = torch.tensor_split(torch.arange(tokens), world)[rank]

    def step() -> None:
        net.zero_grad(set_to_none=True)
        ((net(x[rows]) - y[rows]) ** 2).mean().backward()

    return {"torch_fsdp": median_ms(step, REPEATS)}


def main() -> None:
    os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "mindspore")
    print(f"fully_shard on MindSpore: 2 CPU ranks; median of {REPEATS} forward+backward steps (ms)")
    print(f"{'MS mode':>8} {'hidden':>6} {'blocks':>6} {'tokens':>6} | {'MS 1 proc':>9} {'MS fsdp':>8} "
          f"{'torch fsdp':>10} | {'MS fsdp / 1 proc':>16} {'MS fsdp / torch':>15} | param bytes per rank / whole")
    ms_env = {"HYPER_PARALLEL_PLATFORM": "mindspore"}
    # blocking: the backend's set_num_threads(1), which every rank pool calls by default;
    # async: the pool leaves MindSpore's defaults (threads_per_rank=None)
    with RankPool(2, timeout=600, env=ms_env, threads_per_rank=None) as async_pool, \
            RankPool(2, timeout=600, env=ms_env) as block_pool, \
            RankPool(2, timeout=600, env={"HYPER_PARALLEL_PLATFORM": "torch"}) as torch_pool:
        for d, blocks, tokens in SIZES:
            ours_torch = max(r["torch_fsdp"] for r in torch_pool.run(_torch_fsdp, d, blocks, tokens))
            for mode, ms_pool in (("async", async_pool), ("blocking", block_pool)):
                single = ms_pool.run(_ms_single, d, blocks, tokens)[0]
                fsdp = ms_pool.run(_ms_fsdp, d, blocks, tokens)
                ours_ms = max(r["ms_fsdp"] for r in fsdp)  # a step ends when its slower rank does
                share = "/".join(f"{r['bytes']:,}" for r in fsdp)
                print(f"{mode:>8} {d:>6} {blocks:>6} {tokens:>6} | {single['ms']:>9.1f} {ours_ms:>8.1f} "
                      f"{ours_torch:>10.1f} | {ours_ms / single['ms']:>16.2f} {ours_ms / ours_torch:>15.2f} | "
                      f"{share} / {single['bytes']:,}", flush=True)


if __name__ == "__main__":
    main()
