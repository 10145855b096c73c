"""SwiGLU MLP forward+backward at tp=2 (gloo, same run, same weights): hyper-parallel's styles vs
torch.distributed.tensor.parallel with the same plan vs a hand-written Megatron-style MLP (local
matmuls, one raw all_reduce in forward and one in backward).  A fourth column runs the
hand-written layer on a styled module's DTensor parameters, which splits ours/hand into what the
parameters cost and what the styles add.

Run: ./pants run benchmarks/tp_mlp.py   (or python benchmarks/tp_mlp.py)
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any

from hp_dtensor.testing import RankPool

SIZES = [(1024, 4096, 512), (256, 1024, 32)]  # hidden, ffn, tokens
REPEATS = 9


def build_swiglu(hidden: int, ffn: int) -> Any:
    """The Qwen-style SwiGLU MLP both TP benchmarks time (gate/up Colwise, down Rowwise)."""
    from torch import nn

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(hidden, ffn, bias=False)
            self.up_proj = nn.Linear(hidden, ffn, bias=False)
            self.down_proj = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    return SwiGLU()


def _megatron(weights: Any) -> Any:
    """Megatron's SwiGLU on local shards: ``weights()`` gives (gate, up, down) for each call."""
    import torch
    import torch.distributed as dist

    class _Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:  # type: ignore[override]
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:  # type: ignore[override]
            return g

    class _Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:  # type: ignore[override]
            return x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:  # type: ignore[override]
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    def fwd(x: Any) -> Any:
        gate, up, down = weights()
        x = _Copy.apply(x)
        h = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
        return _Reduce.apply(h @ down.t())

    return fwd


def _hand(ref: Any, rank: int, world: int) -> Any:
    """The hand-written layer: plain tensors holding this rank's shards."""
    gate = ref.gate_proj.weight.detach().chunk(world, 0)[rank].clone().requires_grad_(True)
    up = ref.up_proj.weight.detach().chunk(world, 0)[rank].clone().requires_grad_(True)
    down = ref.down_proj.weight.detach().chunk(world, 1)[rank].clone().requires_grad_(True)
    return _megatron(lambda: (gate, up, down))


def _hand_on_dtensor_params(styled: Any) -> Any:
    """The hand-written layer computing on a styled module's DTensor parameters (``to_local`` of
    each, their gradients DTensors again): what the parameters alone cost over ``hand``."""
    return _megatron(lambda: (styled.gate_proj.weight.to_local(), styled.up_proj.weight.to_local(),
                              styled.down_proj.weight.to_local()))


def _bench(rank: int, world: int) -> list[tuple[str, float, float, float, float]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TCol
    from torch.distributed.tensor.parallel import RowwiseParallel as TRow
    from torch.distributed.tensor.parallel import parallelize_module as tparallelize

    from hp_dtensor import init_device_mesh
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    tmesh = torch_mesh("cpu", (world,))
    rows = []
    for hidden, ffn, tokens in SIZES:
        torch.manual_seed(0)
        ref = build_swiglu(hidden, ffn)
        ours = parallelize_module(copy.deepcopy(ref), mesh, {
            "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
        theirs = tparallelize(copy.deepcopy(ref), tmesh, {
            "gate_proj": TCol(), "up_proj": TCol(), "down_proj": TRow()})
        hand = _hand(ref, rank, world)
        # its own copy of the parameters: gradients accumulate per layer, as in the other columns
        dt_params = _hand_on_dtensor_params(parallelize_module(copy.deepcopy(ref), mesh, {
            "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}))
        x = torch.randn(tokens, hidden)

        def step(fn: Any, x: Any = x) -> None:
            xi = x.clone().requires_grad_(True)
            fn(xi).sum().backward()

        fns = {"ours": ours, "torch": theirs, "hand": hand, "dt": dt_params}
        for fn in fns.values():
            for _ in range(3):
                step(fn)
        iters = 3 if hidden >= 1024 else 30
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(REPEATS):
            for name, fn in fns.items():  # interleaved so machine noise hits all of them alike
                torch.distributed.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    step(fn)
                samples[name].append((time.perf_counter() - t0) / iters * 1e3)
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append((f"h={hidden} ffn={ffn} tokens={tokens}", med["ours"], med["torch"], med["hand"], med["dt"]))
    return rows


def main() -> None:
    with RankPool(2, timeout=900) as pool:
        rows = pool.run(_bench, timeout=900)[0]
    print(f"# tp_mlp: SwiGLU fwd+bwd, tp=2 gloo ranks on {os.cpu_count()} cores, median of {REPEATS} repeats (ms)")
    print(f"{'size':<30}{'ours':>9}{'torch':>9}{'hand':>9}{'ours/hand':>11}{'ours/torch':>12}{'dt/hand':>9}")
    for name, ours, theirs, hand, dt in rows:
        print(f"{name:<30}{ours:>9.2f}{theirs:>9.2f}{hand:>9.2f}{ours / hand:>11.2f}{ours / theirs:>12.2f}"
              f"{dt / hand:>9.2f}")
    print("dt = the hand-written layer on the styled module's DTensor parameters: of ours/hand, the part "
          "dt/hand is what DTensor parameters cost; the rest is the styles' hooks and edge operators")


if __name__ == "__main__":
    main()
