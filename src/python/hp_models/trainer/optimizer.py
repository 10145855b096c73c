"""The optimizer: AdamW over every parameter this rank holds, with the job's betas, eps and
weight decay (defaults: torch's betas and eps, no weight decay), and the learning rate of each
step set from the schedule (``lr_schedule``) before it steps."""

from __future__ import annotations

from typing import Any

from hp_models.job import OptimSettings


def build_optimizer(model: Any, optim: OptimSettings) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                             weight_decay=optim.weight_decay)


def set_lr(opt: Any, lr: float) -> None:
    """The learning rate of the next ``opt.step()`` (every parameter group)."""
    for group in opt.param_groups:
        group["lr"] = lr
