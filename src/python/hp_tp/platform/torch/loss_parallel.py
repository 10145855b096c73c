"""Vocab-parallel cross entropy on torch: the kernels behind ``hp_tp.loss_parallel``.

``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) on logits sharded over the class dim is caught
whole by a torch-function mode and computed by the framework-neutral kernel
(``hp_tp.loss_parallel_kernel``: two all_reduces forward, a local backward); this module
supplies its torch primitives and autograd function.

Separate ``log_softmax`` + ``nll_loss`` calls go through four aten kernels instead:
``_log_softmax`` (all_reduce of the row max and of the row sum of exp), ``nll_loss_forward``
(each rank picks the targets in its vocab slice; one all_reduce of the per-row values), and their
backwards (one all_reduce of the row sums of the gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.placement_types import ReduceOp, Replicate, Shard
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dispatch import pop_interceptor, push_interceptor
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec
from hp_dtensor.redistribute.executor import reduce_over
from hp_tp import loss_parallel_kernel as kernel
from hp_tp import loss_parallel_rules as rules

aten = torch.ops.aten


@contextmanager
def loss_parallel() -> Iterator[None]:
    push_interceptor(override)
    try:
        with _CrossEntropyMode():
            yield
    finally:
        pop_interceptor(override)


class _CrossEntropyMode(TorchFunctionMode):
    """Routes ``F.cross_entropy`` on a class-sharded DTensor to the fused kernel; every other
    call runs unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], DTensor):
            return _cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


def _cross_entropy(input: DTensor, target: Any, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> DTensor:
    if size_average is not None or reduce is not None:
        reduction = rules.legacy_reduction(size_average, reduce)
    # The mode sees the call before autocast does; autocast runs cross_entropy in float32 (torch's
    # fp32 op list), so a bf16/fp16 loss under autocast would be less precise than torch's.
    if input.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(input.device.type):
        input = input.float()  # type: ignore[assignment]
    return kernel.cross_entropy(  # type: ignore[no-any-return]
        _MATH, C.COLLECTIVES, _function, input, target, weight, ignore_index, reduction, label_smoothing
    )


class _TorchLossMath:
    """``LossMath`` on torch tensors."""

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def is_floating(self, t: torch.Tensor) -> bool:
        return t.is_floating_point()

    def is_bool(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.bool

    def as_index(self, t: torch.Tensor) -> torch.Tensor:
        return t.long()

    def requires_grad(self, t: torch.Tensor) -> bool:
        return t.requires_grad

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape)

    def detach(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def cast(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.to(like.dtype)

    def amax(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.shape[dim] == 0:
            shape = list(t.shape)
            shape[dim] = 1
            return t.new_full(shape, float("-inf"))
        return t.amax(dim, keepdim=True)

    def sum(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.sum(dim, keepdim=True)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        return t.sum()

    def exp(self, t: torch.Tensor) -> torch.Tensor:
        return t.exp()

    def log(self, t: torch.Tensor) -> torch.Tensor:
        return t.log()

    def logical_and(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a & b

    def logical_or(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a | b

    def where(self, cond: torch.Tensor, t: torch.Tensor, other: float) -> torch.Tensor:
        return t.masked_fill(~cond, other)

    def clamp(self, t: torch.Tensor, low: int, high: int) -> torch.Tensor:
        return t.clamp(low, high)

    def full(self, like: torch.Tensor, n: int, value: float) -> torch.Tensor:
        return like.new_full((n,), value)

    def cat(self, ts: list[torch.Tensor], dim: int) -> torch.Tensor:
        return torch.cat(ts, dim)

    def unbind(self, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        return t.unbind(dim)

    def unsqueeze(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.unsqueeze(dim)

    def reshape(self, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return t.reshape(shape)

    def narrow(self, t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        return t.narrow(dim, start, length)

    def gather(self, t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        return t.gather(dim, index)

    def scatter_add(self, t: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return t.scatter_add(dim, index, src)

    def take(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t[index]

    def first_value(self, t: torch.Tensor, mask: torch.Tensor) -> int | None:
        return int(t[mask].flatten()[0]) if bool(mask.any()) else None


_MATH = _TorchLossMath()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The kernel's forward and backward as an autograd function of the local logits."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, weight: Any,  # type: ignore[override]
                fwd: Callable[[Any, Any, Any], tuple[Any, Any]], bwd: Callable[[Any, Any], Any]) -> Any:
        out, ctx.saved = fwd(x, target, weight)
        ctx.bwd = bwd
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return ctx.bwd(ctx.saved, grad), None, None, None, None


def _function(fwd: Callable[[Any, Any, Any], tuple[Any, Any]], bwd: Callable[[Any, Any], Any]) -> kernel.ApplyFn:
    return lambda x, target, weight: _VocabParallelCrossEntropy.apply(x, target, weight, fwd, bwd)


def _class_sharded(x: Any, dim: int) -> bool:
    return (
        isinstance(x, DTensor)
        and x.device_mesh.ndim == 1
        and x.placements[0] == Shard(dim % x.ndim)
    )


def _vocab_range(x: DTensor, dim: int) -> tuple[int, int]:
    """(first class, class count) of this rank's slice (the local width keeps indices in bounds)."""
    mesh = x.device_mesh
    start = kernel.vocab_start(int(x.shape[dim]), mesh.size(0), mesh.get_local_rank())
    return start, int(x._local_tensor.shape[dim])


def _reduce(t: torch.Tensor, op: ReduceOp, mesh: DeviceMesh) -> torch.Tensor:
    """``t`` reduced over the (1-D) vocab mesh, through the plan walker."""
    return reduce_over(t, mesh, (0,), op, C.COLLECTIVES)  # type: ignore[no-any-return]


def _log_softmax(x: DTensor, dim: int, half_to_float: bool) -> Any:
    local = x._local_tensor
    mesh = x.device_mesh
    row_max = _reduce(_MATH.amax(local.detach(), dim), "max", mesh)
    shifted = local - row_max
    sum_exp = _reduce(shifted.exp().sum(dim, keepdim=True), "sum", mesh)
    return DTensor(shifted - sum_exp.log(), x._spec)


def _log_softmax_backward(grad: DTensor, output: DTensor, dim: int, input_dtype: Any) -> Any:
    g = grad._local_tensor
    row_sum = _reduce(g.sum(dim, keepdim=True), "sum", output.device_mesh)
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
    t = target.long() - start  # uint8 targets would wrap
    owned = (t >= 0) & (t < n) & (target != ignore_index)
    idx = t.clamp(0, max(n - 1, 0)).unsqueeze(1)
    return idx, owned, target != ignore_index


def _nll_forward(logp: DTensor, target: Any, weight: Any, reduction: int, ignore_index: int) -> Any:
    if weight is not None:
        raise NotImplementedError(
            "loss_parallel does not support class weights in nll_loss after log_softmax; "
            "call F.cross_entropy(logits, target, weight=...) instead"
        )
    if logp.ndim != 2:
        raise NotImplementedError(
            f"loss_parallel expects logits flattened to (tokens, vocab), got {logp.ndim}-D; "
            f"use logits.flatten(0, -2) and target.flatten()"
        )
    tgt = _local_target(target)
    # an out-of-range target would be owned by no rank and silently add 0 to the loss
    bad = (tgt != ignore_index) & ((tgt < 0) | (tgt >= logp.shape[1]))
    rules.check_target_range(_MATH.first_value(tgt, bad))
    local = logp._local_tensor
    idx, owned, valid = _picked(logp, tgt, ignore_index)
    # select, not multiply: a -inf log-prob of a class this rank does not own must not make NaN
    if local.shape[1]:
        per_row = (-local.gather(1, idx).squeeze(1)).masked_fill(~owned, 0.0)
    else:
        per_row = local.new_zeros(local.shape[0])
    per_row = _reduce(per_row, "sum", logp.device_mesh)
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
    if local.shape[1]:  # a rank holding no class has no gradient to place
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
