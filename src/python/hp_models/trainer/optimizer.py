"""The optimizer: AdamW without weight decay over every parameter this rank holds."""

from __future__ import annotations

from typing import Any


def build_optimizer(model: Any, lr: float) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
