"""Vocab-parallel cross entropy: the kernels behind ``hp_tp.loss_parallel``.

Inside the context, four aten ops on class-dim-sharded DTensors are computed without gathering
the class dim: ``_log_softmax`` (all_reduce of the row max and of the row sum of exp),
``nll_loss_forward`` (each rank picks the targets in its vocab slice; one all_reduce of the
per-row values), and their backwards (one all_reduce of the row sums of the gradient).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hp_dtensor.placement_types import Replicate, Shard
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec

aten = torch.ops.aten
_state = threading.local()


def enabled() -> bool:
    return bool(getattr(_state, "depth", 0))


@contextmanager
def loss_parallel() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _class_sharded(x: Any, dim: int) -> bool:
    return (
        isinstance(x, DTensor)
        and x.device_mesh.ndim == 1
        and x.placements[0] == Shard(dim % x.ndim)
    )


def _vocab_range(x: DTensor, dim: int) -> tuple[int, int]:
    n = x._local_tensor.shape[dim]
    start = x.device_mesh.get_local_rank() * n
    return start, n


def _group(x: DTensor) -> tuple[Any, int]:
    mesh = x.device_mesh
    return mesh.get_group(0), mesh.size(0)


def _log_softmax(x: DTensor, dim: int, half_to_float: bool) -> Any:
    local = x._local_tensor
    group, n = _group(x)
    row_max = C.all_reduce(local.detach().amax(dim, keepdim=True), "max", group, n)
    shifted = local - row_max
    sum_exp = C.all_reduce(shifted.exp().sum(dim, keepdim=True), "sum", group, n)
    return DTensor(shifted - sum_exp.log(), x._spec)


def _log_softmax_backward(grad: DTensor, output: DTensor, dim: int, input_dtype: Any) -> Any:
    group, n = _group(output)
    g = grad._local_tensor
    row_sum = C.all_reduce(g.sum(dim, keepdim=True), "sum", group, n)
    return DTensor(g - output._local_tensor.exp() * row_sum, output._spec)


def _local_target(target: Any) -> torch.Tensor:
    if isinstance(target, DTensor):
        if any(not p.is_replicate() for p in target.placements):
            target = target.full_tensor()
        else:
            target = target._local_tensor
    return target  # type: ignore[no-any-return]


def _picked(logp: DTensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    start, n = _vocab_range(logp, 1)
    t = target - start
    owned = (t >= 0) & (t < n) & (target != ignore_index)
    idx = t.clamp(0, n - 1).unsqueeze(1)
    return idx, owned, target != ignore_index


def _nll_forward(logp: DTensor, target: Any, weight: Any, reduction: int, ignore_index: int) -> Any:
    if weight is not None:
        raise NotImplementedError("loss_parallel does not support class weights in cross_entropy")
    if logp.ndim != 2:
        raise NotImplementedError(
            f"loss_parallel expects logits flattened to (tokens, vocab), got {logp.ndim}-D; "
            f"use logits.flatten(0, -2) and target.flatten()"
        )
    tgt = _local_target(target)
    local = logp._local_tensor
    idx, owned, valid = _picked(logp, tgt, ignore_index)
    per_row = -local.gather(1, idx).squeeze(1) * owned
    group, n = _group(logp)
    per_row = C.all_reduce(per_row, "sum", group, n)
    count = valid.sum().to(local.dtype)
    mesh = logp.device_mesh
    rep = (Replicate(),)
    if reduction == 0:
        out = per_row
    elif reduction == 1:
        out = per_row.sum() / count
    else:
        out = per_row.sum()
    return (
        DTensor(out, DTensorSpec(mesh, rep, tuple(out.shape))),
        DTensor(count, DTensorSpec(mesh, rep, ())),
    )


def _nll_backward(grad_out: Any, logp: DTensor, target: Any, weight: Any, reduction: int, ignore_index: int,
                  total_weight: Any) -> Any:
    tgt = _local_target(target)
    local = logp._local_tensor
    idx, owned, _ = _picked(logp, tgt, ignore_index)
    g = grad_out._local_tensor if isinstance(grad_out, DTensor) else grad_out
    tw = total_weight._local_tensor if isinstance(total_weight, DTensor) else total_weight
    if reduction == 1:
        scale = (g / tw).expand(local.shape[0])
    elif reduction == 2:
        scale = g.expand(local.shape[0])
    else:
        scale = g
    grad = torch.zeros_like(local)
    grad.scatter_(1, idx, (-scale * owned).unsqueeze(1).to(local.dtype))
    return DTensor(grad, logp._spec)


def override(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The loss-parallel kernel for this call, or None when the call is not one it handles."""
    if func is aten._log_softmax.default and _class_sharded(args[0], args[1]):
        return lambda: _log_softmax(*args, **kwargs)
    if func is aten._log_softmax_backward_data.default and _class_sharded(args[1], args[2]):
        return lambda: _log_softmax_backward(*args, **kwargs)
    if func is aten.nll_loss_forward.default and _class_sharded(args[0], 1):
        return lambda: _nll_forward(*args, **kwargs)
    if func is aten.nll_loss_backward.default and _class_sharded(args[1], 1):
        return lambda: _nll_backward(*args, **kwargs)
    return None
