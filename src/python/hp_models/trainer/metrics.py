"""What each step reports: the progress bar on rank 0, and the metrics of every step (loss,
learning rate, gradient norm, tokens/s, peak memory of every rank) kept for ``log.json`` and
written as TensorBoard scalars to ``<out-dir>/tensorboard/`` by rank 0 (a resumed run adds a file
there, its steps continuing; a fresh run first removes the event files an earlier run left).

Peak memory on these CPU ranks is the process's peak resident set (``ru_maxrss``), gathered from
every rank each step (one small all-reduce).
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hp_models.trainer.tensorboard import EventWriter

TENSORBOARD_DIR = "tensorboard"


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _every_rank(value: float, rank: int, world: int) -> list[float]:
    """``value`` of every rank (rank order); one all-reduce."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(world, dtype=torch.float64)
    t[rank] = value
    dist.all_reduce(t)
    return [float(x) for x in t.tolist()]


@dataclass
class Metrics:
    """The run's per-step metrics on this rank; rank 0 (``write``) also writes the event files."""

    rank: int
    world: int
    distributed: bool
    logdir: str | None  # None: no event files (the ranks other than 0, test and reference runs)
    fresh: bool = True  # a run from step 0: event files of an earlier run in ``logdir`` are removed first
    learning_rates: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    peak_memory_mib: list[float] = field(default_factory=list)  # per rank, the run's peak so far
    # ``value`` of every rank, by rank (one collective); None: torch.distributed's all_reduce
    every_rank: Callable[[float, int, int], list[float]] | None = None
    _writer: EventWriter | None = None

    def record(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, seconds: float) -> None:
        """Step ``step`` (1-based, the count of optimizer steps done) has run; collective."""
        mine = peak_rss_mib()
        gather = self.every_rank or _every_rank
        self.peak_memory_mib = gather(mine, self.rank, self.world) if self.distributed else [mine]
        tok_s = tokens / max(seconds, 1e-9)
        self.learning_rates.append(lr)
        self.grad_norms.append(grad_norm)
        self.tokens_per_s.append(tok_s)
        if self.logdir is None:
            return
        if self._writer is None:
            if self.fresh:
                clear_event_files(self.logdir)
            self._writer = EventWriter(self.logdir)
        scalars = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s,
                   "peak_memory_mib/max": max(self.peak_memory_mib)}
        scalars.update({f"peak_memory_mib/rank_{r}": m for r, m in enumerate(self.peak_memory_mib)})
        self._writer.add_scalars(step, scalars)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def report(self) -> dict[str, Any]:
        """What the run's result (and ``log.json``) carries of them."""
        return {"learning_rates": self.learning_rates, "grad_norms": self.grad_norms,
                "step_tokens_per_s": self.tokens_per_s, "peak_memory_mib_per_rank": self.peak_memory_mib,
                "tensorboard_dir": self.logdir}


def clear_event_files(logdir: str) -> None:
    """Remove the event files of an earlier run (a fresh run's curves would mix with them)."""
    if os.path.isdir(logdir):
        for name in os.listdir(logdir):
            if name.startswith("events.out.tfevents."):
                os.remove(os.path.join(logdir, name))


def tensorboard_dir(out_dir: str) -> str:
    return os.path.join(out_dir, TENSORBOARD_DIR)


def progress_line(step: int, total: int, loss: float, lr: float, tok_s: float) -> str:
    """The progress bar's text after step ``step`` of ``total``: the loss, the step's learning
    rate and the run's tokens/s."""
    width = 30
    filled = int(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    return f"[{bar}] step {step}/{total}  loss {loss:.4f}  lr {lr:.3e}  {tok_s:,.0f} tok/s"


def progress(step: int, total: int, loss: float, lr: float, tok_s: float) -> None:
    line = progress_line(step, total, loss, lr, tok_s)
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line)
    elif step == total or step % max(1, total // 20) == 0:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
