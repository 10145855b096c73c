"""A training step of a stack of transformer-like blocks, 2 gloo ranks, same run, same weights:
hp_fsdp's ``fully_shard`` against torch's own ``torch.distributed.fsdp.fully_shard`` (FSDP2) on the
plain torch model.  Both shard the blocks first, then the root, and step AdamW over
``model.parameters()``.

Printed per size: step time (zero_grad + forward + backward + AdamW step, median of repeated
steps after warm-up, the two interleaved so machine noise hits both alike); peak RSS per rank
while stepping (fresh processes per library, so one's allocations never count for the other);
per-rank bytes of parameters + gradients + AdamW state (the shares FSDP exists to cut); and the
largest loss difference over the first steps, so the two are known to compute the same thing.

Run: ./pants run benchmarks/fsdp.py   (or python benchmarks/fsdp.py)
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from hp_dtensor.testing import RankPool

LIBS = ("ours", "torch")
REPEATS = 15  # timed steps per library, after WARMUP
BATCHES = 3  # per rank, used in turn
WARMUP = 4  # untimed steps, whose losses are compared (the last one repeats the first batch)
# AdamW's two code paths: a loop of per-tensor ops (the default on CPU) and multi-tensor
# ``_foreach`` ops (the default on CUDA).
FOREACH = (False, True)


@dataclass(frozen=True)
class Size:
    hidden: int
    ffn: int
    blocks: int
    tokens: int  # per rank

    def __str__(self) -> str:
        return f"h={self.hidden} ffn={self.ffn} L={self.blocks} tok={self.tokens}"


# a compute-heavy step, and a small one where per-op and per-collective overheads dominate
SIZES = [Size(256, 1024, 6, 256), Size(128, 512, 8, 32)]


def _build(size: Size) -> Any:
    """Input projection, ``blocks`` pre-norm MLP blocks, final norm and head (odd row counts, so
    dim 0 of some parameters does not divide by the world size)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(size.hidden)
            self.up = nn.Linear(size.hidden, size.ffn)
            self.down = nn.Linear(size.ffn, size.hidden)

        def forward(self, x: Any) -> Any:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(size.hidden, size.hidden)
            self.layers = nn.ModuleList(Block() for _ in range(size.blocks))
            self.norm = nn.LayerNorm(size.hidden)
            self.head = nn.Linear(size.hidden, 33)

        def forward(self, x: Any) -> Any:
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Net()


def _shard(lib: str, model: Any, world: int) -> Any:
    """``model`` sharded by ``lib``: every block, then the root."""
    if lib == "ours":
        from hp_dtensor import init_device_mesh
        from hp_fsdp import fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _setup(
    lib: str, size: Size, rank: int, world: int, foreach: bool = False
) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    import torch

    model = _shard(lib, _build(size), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data, as in data parallelism
    batches = [(torch.randn(size.tokens, size.hidden, generator=gen),
                torch.randint(0, 33, (size.tokens,), generator=gen)) for _ in range(BATCHES)]
    return model, opt, batches


def _step(model: Any, opt: Any, batch: tuple[Any, Any]) -> float:
    import torch

    opt.zero_grad()
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _local_bytes(t: Any) -> int:
    local = getattr(t, "_local_tensor", t)
    return int(local.numel() * local.element_size())


def _state_bytes(model: Any, opt: Any) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (padding not counted)."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p)
        if p.grad is not None:
            total += _local_bytes(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "numel") and v.dim() > 0:
                total += _local_bytes(v)
    return total


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory(rank: int, world: int, lib: str, size: Size) -> tuple[float, float, int]:
    """In a fresh rank process: (MiB peak RSS while stepping, MiB RSS before building the model,
    bytes of params+grads+optimizer state after the steps)."""
    import gc

    base = _rss_kib("VmRSS")
    model, opt, batches = _setup(lib, size, rank, world)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak (VmHWM) from the current RSS
        f.write("5")
    for i in range(WARMUP):
        _step(model, opt, batches[i % len(batches)])
    return _rss_kib("VmHWM") / 1024, base / 1024, _state_bytes(model, opt)


def _timing(rank: int, world: int, size: Size, foreach: bool) -> tuple[dict[str, float], float]:
    """(median ms per step of each library, in the same processes, interleaved step by step;
    largest difference between the two libraries' losses over the warm-up steps)."""
    import torch.distributed as dist

    runs = {lib: _setup(lib, size, rank, world, foreach) for lib in LIBS}
    losses = {lib: [_step(model, opt, batches[i % len(batches)]) for i in range(WARMUP)]
              for lib, (model, opt, batches) in runs.items()}
    # the batches repeat: the first one again must give a lower loss, or nothing was trained
    if not all(ls[-1] < ls[0] for ls in losses.values()):
        raise AssertionError(f"the loss did not fall over {WARMUP} steps: {losses}")
    samples: dict[str, list[float]] = {lib: [] for lib in LIBS}
    for i in range(REPEATS):
        for lib, (model, opt, batches) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, opt, batches[i % len(batches)])
            samples[lib].append((time.perf_counter() - t0) * 1e3)
    diff = max(abs(a - b) for a, b in zip(losses["ours"], losses["torch"]))
    return {lib: statistics.median(v) for lib, v in samples.items()}, diff


def main() -> None:
    world = 2
    mem: dict[tuple[str, Size], list[tuple[float, float, int]]] = {}
    for lib in LIBS:
        for size in SIZES:  # fresh processes each: a peak RSS is this library's and size's alone
            with RankPool(world, timeout=900) as pool:
                mem[(lib, size)] = pool.run(_memory, lib, size, timeout=900)
    times: dict[tuple[Size, bool], list[tuple[dict[str, float], float]]] = {}
    with RankPool(world, timeout=900) as pool:
        for size in SIZES:
            for foreach in FOREACH:
                times[(size, foreach)] = pool.run(_timing, size, foreach, timeout=900)

    # the load average says how much other work shared the cores while this ran
    print(f"# fsdp: AdamW training step, {world} gloo ranks (1 thread each) on {os.cpu_count()} cores "
          f"(load average {os.getloadavg()[0]:.1f}); ms = median of {REPEATS} steps after {WARMUP} (slowest rank)")
    print(f"{'size':<28}{'adamw':>8}{'ours ms':>9}{'torch ms':>9}{'time':>6}{'loss diff':>10}"
          f"{'ours MiB':>9}{'torch MiB':>10}{'rss':>6}{'state MiB':>10}{'state':>6}")
    for size in SIZES:
        # peak RSS while stepping above the RSS before the model was built; state: params+grads+AdamW
        rss = {lib: max(peak - base for peak, base, _ in mem[(lib, size)]) for lib in LIBS}
        state = {lib: max(r[2] for r in mem[(lib, size)]) for lib in LIBS}
        for foreach in FOREACH:
            runs = times[(size, foreach)]
            t = {lib: max(r[0][lib] for r in runs) for lib in LIBS}
            diff = max(r[1] for r in runs)
            line = (f"{size!s:<28}{'foreach' if foreach else 'loop':>8}{t['ours']:>9.1f}{t['torch']:>9.1f}"
                    f"{t['ours'] / t['torch']:>6.2f}{diff:>10.1e}")
            if not foreach:  # memory is measured once per size, with the loop
                line += (f"{rss['ours']:>9.1f}{rss['torch']:>10.1f}{rss['ours'] / rss['torch']:>6.2f}"
                         f"{state['ours'] / 2**20:>10.2f}{state['ours'] / state['torch']:>6.2f}")
            print(line)
    print("# time, rss, state: ours/torch (target <= 1.00). rss: peak RSS while stepping minus RSS before "
          "building the model, worst rank; state: per-rank bytes of params + grads + AdamW state")


if __name__ == "__main__":
    main()
