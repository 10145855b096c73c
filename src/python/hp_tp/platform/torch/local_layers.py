"""Local kernels for styled layers whose layouts are fixed when the style is applied.

A ``ColwiseParallel`` / ``RowwiseParallel`` Linear or Embedding computes on the local shard of its
weight with plain torch ops (no DTensor dispatch per op); the styles wrap the result back into a
DTensor of the known layout, so the only collectives are the planned layout changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def is_plain_linear(m: Any) -> bool:
    """Exactly ``nn.Linear`` (a subclass may override ``forward``)."""
    return type(m) is nn.Linear


def is_plain_embedding(m: Any) -> bool:
    """Exactly ``nn.Embedding`` with a dense lookup and no renormalization."""
    return type(m) is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq and not m.sparse


def set_forward(m: nn.Module, fn: Callable[..., Any]) -> None:
    """Run ``fn`` as ``m``'s forward (hooks still run around it)."""
    m.forward = fn  # type: ignore[method-assign]


def grad_enabled() -> bool:
    return torch.is_grad_enabled()


def version(t: torch.Tensor) -> int | None:
    """In-place modification counter: a cached view of ``t`` is stale once it changes.  None for
    a tensor that keeps no counter (one made under inference mode): its in-place changes cannot be
    detected, so nothing derived from it may be cached."""
    return None if t.is_inference() else int(t._version)


def inference_mode() -> bool:
    """Whether inference mode is on: what is made now is an inference tensor, which code running
    outside inference mode may not change in place."""
    return torch.is_inference_mode_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    return F.embedding(ids, weight, padding_idx)


def check_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """Fail like ``nn.Embedding`` on ids outside the table (every rank holds the same ids)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise IndexError(
            f"index out of range in self: token ids must lie in [0, {num_embeddings}), got "
            f"min {int(ids.min())} max {int(ids.max())}"
        )


def vocab_slice_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int,
                          padding_idx: int | None) -> torch.Tensor:
    """This rank's partial sum of a lookup in a table split by rows: rows ``[start, start + n)``
    are looked up here, every other id gives zeros (and no gradient)."""
    n = weight.shape[0]
    outside = (ids < start) | (ids >= start + n)
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + n else None
    out = F.embedding((ids - start).masked_fill(outside, 0), weight, local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def is_tokenwise_module(m: Any) -> bool:
    """A module whose forward acts on each position on its own and draws no random numbers, so
    it can run on a sequence shard: torch's LayerNorm and RMSNorm, or a class that declares
    ``hp_tokenwise = True``."""
    return type(m) in (nn.LayerNorm, nn.RMSNorm) or getattr(type(m), "hp_tokenwise", False) is True


def run_with_params(m: nn.Module, forward: Callable[..., Any], params: dict[str, torch.Tensor],
                    *args: Any, **kwargs: Any) -> Any:
    """Call ``forward`` with ``m``'s own parameters replaced by ``params`` for the call only."""
    saved = {name: m._parameters[name] for name in params}
    try:
        for name, value in params.items():
            m._parameters[name] = value  # type: ignore[assignment]
        return forward(*args, **kwargs)
    finally:
        m._parameters.update(saved)


def normalized_ndim(m: Any) -> int:
    """How many trailing dims a token-wise module reduces over (a shard must not split them)."""
    shape = getattr(m, "normalized_shape", None)
    return len(shape) if isinstance(shape, (tuple, list)) else 1
