"""Local kernels for styled layers whose layouts are fixed when the style is applied.

A ``ColwiseParallel`` / ``RowwiseParallel`` Linear or Embedding computes on the local shard of its
weight with plain torch ops (no DTensor dispatch per op); the styles wrap the result back into a
DTensor of the known layout, so the only collectives are the planned layout changes.  Where plain
tensors come in and go out, the two Megatron operators stand at the layer's edges instead
(``replicate_input``, ``sum_partial_output``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_hooks

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.platform.torch import collectives as C


def is_plain_linear(m: Any) -> bool:
    """Exactly ``nn.Linear`` (a subclass may override ``forward``)."""
    return type(m) is nn.Linear


def is_plain_embedding(m: Any) -> bool:
    """Exactly ``nn.Embedding`` with a dense lookup and no renormalization."""
    return type(m) is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq and not m.sparse


def set_forward(m: nn.Module, fn: Callable[..., Any]) -> None:
    """Run ``fn`` as ``m``'s forward (hooks still run around it)."""
    m.forward = fn  # type: ignore[method-assign]


def is_plain_tensor(x: Any) -> bool:
    """Exactly a ``torch.Tensor``: not a DTensor, a Parameter or another subclass."""
    return type(x) is torch.Tensor


def only_own_hooks(m: nn.Module, pre: int, post: int) -> bool:
    """``m`` runs exactly ``pre`` forward pre-hooks and ``post`` forward hooks (the style's) and no
    backward or global module hooks: nothing else sees what passes between them."""
    return (len(m._forward_pre_hooks) == pre and len(m._forward_hooks) == post
            and not m._backward_hooks and not m._backward_pre_hooks
            and not _module_hooks._global_forward_pre_hooks and not _module_hooks._global_forward_hooks
            and not _module_hooks._global_backward_hooks and not _module_hooks._global_backward_pre_hooks)


def requires_grad(x: torch.Tensor) -> bool:
    return x.requires_grad


class _ReplicateInput(torch.autograd.Function):
    """Identity forward; the gradient, a partial sum on each rank, is all-reduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        mesh = ctx.mesh
        return C.all_reduce(g, "sum", mesh.get_group(0), mesh.size(0)), None


class _SumPartialOutput(torch.autograd.Function):
    """All-reduce forward (each rank holds a partial sum); the gradient of the sum passes as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        return C.all_reduce(x, "sum", mesh.get_group(0), mesh.size(0))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


def replicate_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x``, replicated on the 1-D ``mesh``, entering column-parallel layers: their input
    gradients are partial sums, all-reduced here once for every layer that used it."""
    return _ReplicateInput.apply(x, mesh)  # type: ignore[no-any-return]


def sum_partial_output(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A row-parallel layer's partial sums ``x`` summed over the 1-D ``mesh`` (all_reduce)."""
    return _SumPartialOutput.apply(x, mesh)  # type: ignore[no-any-return]


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
