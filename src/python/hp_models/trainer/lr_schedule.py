"""The learning rate of each optimizer step: a linear warmup, then a cosine or linear decay.

A closed form of the step index (no state), so a resumed run continues the schedule from its
step alone.  Step ``s`` (0-based: the ``s + 1``-th optimizer step) with ``n = s + 1``, peak ``lr``,
``W`` warmup and ``D`` decay steps:

- warmup, ``n <= W``: ``lr * n / W`` (the first step already moves; step ``W`` reaches ``lr``);
- decay, with ``p = min((n - W) / D, 1)``: cosine ``lr_min + (lr - lr_min) * (1 + cos(pi p)) / 2``,
  linear ``lr_min + (lr - lr_min) * (1 - p)`` (step ``W + D`` reaches ``lr_min``, later steps stay
  there); no decay: ``lr``.

Without warmup and decay (the default) every step has ``lr``: the constant rate of before.  A
warmup given as a share of the run (``lr_warmup_ratio``, from a MindFormers ``warmup_ratio``) is
``W = int(ratio * steps)`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hp_models.job import OptimSettings
from hp_protocols import LRDecay


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    warmup_steps: int = 0
    decay: LRDecay = LRDecay.NONE
    decay_steps: int = 1
    lr_min: float = 0.0

    @classmethod
    def of(cls, lr: float, optim: OptimSettings, steps: int) -> LRSchedule:
        """The schedule of a run of ``steps`` steps; ``ValueError`` naming the values when the decay
        has no step left (its default length: ``steps`` minus the warmup) or ends above the peak."""
        warmup = int(optim.warmup_ratio * steps) if optim.warmup_ratio is not None else optim.warmup_steps
        if optim.decay is LRDecay.NONE:
            return cls(lr=lr, warmup_steps=warmup)
        if optim.lr_min > lr:
            raise ValueError(f"lr_min {optim.lr_min} is above the peak learning rate {lr} (--lr, or the job's "
                             f"learning_rate): the decay would raise it; pass a smaller lr_min (--lr-min)")
        decay_steps = optim.decay_steps if optim.decay_steps is not None else steps - warmup
        if decay_steps < 1:
            raise ValueError(f"lr_decay {optim.decay.value} after lr_warmup_steps {warmup} leaves no step "
                             f"of --steps {steps} to decay over; pass fewer warmup steps, more --steps, or "
                             f"lr_decay_steps (--lr-decay-steps)")
        return cls(lr=lr, warmup_steps=warmup, decay=optim.decay, decay_steps=decay_steps, lr_min=optim.lr_min)

    @property
    def constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay is LRDecay.NONE

    def at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        n = step + 1
        if n <= self.warmup_steps:
            return self.lr * n / self.warmup_steps
        if self.decay is LRDecay.NONE:
            return self.lr
        p = min((n - self.warmup_steps) / self.decay_steps, 1.0)
        if self.decay is LRDecay.COSINE:
            return self.lr_min + (self.lr - self.lr_min) * 0.5 * (1.0 + math.cos(math.pi * p))
        return self.lr_min + (self.lr - self.lr_min) * (1.0 - p)

    def as_dict(self) -> dict[str, Any]:
        """What the run's log and a checkpoint's run settings keep of it."""
        out: dict[str, Any] = {"warmup_steps": self.warmup_steps, "decay": self.decay.value}
        if self.decay is not LRDecay.NONE:
            out.update({"decay_steps": self.decay_steps, "lr_min": self.lr_min})
        return out
