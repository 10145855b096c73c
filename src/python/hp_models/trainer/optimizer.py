"""The optimizer: AdamW without weight decay over every parameter this rank holds, and the
learning rate of each step set from the schedule (``lr_schedule``) before it steps."""

from __future__ import annotations

from typing import Any


def build_optimizer(model: Any, lr: float) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def set_lr(opt: Any, lr: float) -> None:
    """The learning rate of the next ``opt.step()`` (every parameter group)."""
    for group in opt.param_groups:
        group["lr"] = lr
