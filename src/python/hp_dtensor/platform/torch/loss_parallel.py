"""Vocab-parallel cross entropy: the kernels behind ``hp_tp.loss_parallel``.

``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) on logits sharded over the class dim is caught
whole by a torch-function mode and computed like a hand-written vocab-parallel loss: one
all_reduce of the row max, one all_reduce of the row sums (sum of exp, the target's logit, the
label-smoothing sum) stacked together, and a backward that is purely local (the softmax gradient
is folded into the loss gradient).  Its whole argument surface is supported: any ``(N, C, d1,
...)`` or ``(C,)`` input, class-index or class-probability targets, ``weight``, ``ignore_index``,
``label_smoothing``, every ``reduction``; arguments are checked on every rank before any
collective (``hp_dtensor.loss_parallel_rules``).

Separate ``log_softmax`` + ``nll_loss`` calls go through four aten kernels instead:
``_log_softmax`` (all_reduce of the row max and of the row sum of exp), ``nll_loss_forward``
(each rank picks the targets in its vocab slice; one all_reduce of the per-row values), and their
backwards (one all_reduce of the row sums of the gradient).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hp_dtensor import loss_parallel_rules as rules
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.placement_types import ReduceOp, Replicate, Shard
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec
from hp_dtensor.redistribute_exec import reduce_over

aten = torch.ops.aten
_state = threading.local()


def enabled() -> bool:
    return bool(getattr(_state, "depth", 0))


@contextmanager
def loss_parallel() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _CrossEntropyMode():
            yield
    finally:
        _state.depth -= 1


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
    mesh = input.device_mesh
    tgt = _replicated_local(target)
    w = _replicated_local(weight) if weight is not None else None
    call = rules.check_cross_entropy(
        tuple(input.shape), tuple(input.placements), tuple(tgt.shape), tgt.is_floating_point(),
        None if w is None else tuple(w.shape), reduction, label_smoothing,
    )
    if (w is not None and w.requires_grad) or (tgt.is_floating_point() and tgt.requires_grad):
        raise NotImplementedError(
            "loss_parallel computes no gradient for cross_entropy's weight or target; detach them"
        )
    n_local = input._local_tensor.shape[call.class_dim]
    start = mesh.get_local_rank(0) * -(-call.num_classes // mesh.size(0))
    if call.target_kind is rules.TargetKind.CLASS_INDEX:
        # Targets are whole on every rank, so this check gives the same answer everywhere.
        bad = (tgt != ignore_index) & ((tgt < 0) | (tgt >= call.num_classes))
        rules.check_target_range(int(tgt[bad].flatten()[0]) if bool(bad.any()) else None)
    else:
        tgt = tgt.narrow(call.class_dim, start, n_local)
    local = input.to_local()
    loss = _VocabParallelCrossEntropy.apply(
        local, tgt, w, call, ignore_index, start, mesh
    )
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


def _replicated_local(t: Any) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.full_tensor() if any(not p.is_replicate() for p in t.placements) else t._local_tensor
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"loss_parallel: cross_entropy expects tensor target/weight, got {type(t).__name__}")
    return t


def _class_view(t: torch.Tensor, cdim: int, ndim: int) -> torch.Tensor:
    """``t`` of shape (C_local,) shaped to broadcast along the class dim of an ``ndim``-D input."""
    shape = [1] * ndim
    shape[cdim] = t.shape[0]
    return t.reshape(shape)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss on the local class slice; collectives in forward only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,  # type: ignore[override]
                call: rules.CrossEntropyCall, ignore_index: int, start: int, mesh: DeviceMesh) -> torch.Tensor:
        cdim, nc, eps = call.class_dim, call.num_classes, call.label_smoothing
        n_local = x.shape[cdim]
        w_local = None if weight is None else _class_view(weight.narrow(0, start, n_local).to(x.dtype), cdim, x.ndim)
        row_max = _reduce(x.detach().amax(cdim, keepdim=True), "max", mesh)
        shifted = x.detach() - row_max
        exp = shifted.exp()
        if call.target_kind is rules.TargetKind.CLASS_INDEX:
            valid = target != ignore_index
            t = (target - start).unsqueeze(cdim)
            owned = valid.unsqueeze(cdim) & (t >= 0) & (t < n_local)
            picked = shifted.gather(cdim, t.clamp(0, n_local - 1)) * owned
            smooth = (shifted if w_local is None else shifted * w_local).sum(cdim, keepdim=True)
            sums = _reduce(torch.cat([exp.sum(cdim, keepdim=True), picked, smooth], cdim), "sum", mesh)
            sum_exp, picked, smooth = sums.unbind(cdim)
            lse = sum_exp.log()
            w_total: float | torch.Tensor
            if weight is None:
                w_t, w_total = valid.to(x.dtype), float(nc)
            else:
                w_t = weight.to(x.dtype)[target.masked_fill(~valid, 0)] * valid
                w_total = weight.to(x.dtype).sum()
            nll = -(picked - lse) * w_t
            smooth_loss = -(smooth - lse * w_total) * valid
            per = (1 - eps) * nll + (eps / nc) * smooth_loss
            denom = w_t.sum()
        else:
            y = target.to(x.dtype) * (1 - eps) + eps / nc
            wy = y if w_local is None else y * w_local
            sums = _reduce(
                torch.cat([exp.sum(cdim, keepdim=True), (wy * shifted).sum(cdim, keepdim=True),
                           wy.sum(cdim, keepdim=True)], cdim), "sum", mesh)
            sum_exp, wy_x, wy_sum = sums.unbind(cdim)
            lse = sum_exp.log()
            per = -(wy_x - lse * wy_sum)
            denom = torch.tensor(float(per.numel()), dtype=x.dtype)
        if call.reduction is rules.Reduction.NONE:
            out = per
        elif call.reduction is rules.Reduction.SUM:
            out = per.sum()
        else:
            out = per.sum() / denom
        ctx.call, ctx.ignore_index, ctx.start, ctx.w_total = call, ignore_index, start, w_total if (
            call.target_kind is rules.TargetKind.CLASS_INDEX) else None
        if call.target_kind is rules.TargetKind.CLASS_INDEX:
            ctx.save_for_backward(shifted, lse, target, w_t, w_local, denom)
        else:
            ctx.save_for_backward(shifted, lse, wy, wy_sum, denom)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        call = ctx.call
        cdim, nc, eps = call.class_dim, call.num_classes, call.label_smoothing
        if call.reduction is rules.Reduction.MEAN:
            g = grad / ctx.saved_tensors[-1]
        else:
            g = grad
        if call.target_kind is rules.TargetKind.CLASS_INDEX:
            shifted, lse, target, w_t, w_local, _ = ctx.saved_tensors
            valid = target != ctx.ignore_index
            prob = (shifted - lse.unsqueeze(cdim)).exp()
            n_local = shifted.shape[cdim]
            # d loss / d x_c = (1 - eps) w_t (p_c - [c = t]) + eps / C (W p_c - w_c) on valid rows,
            # W the sum of all class weights: local, no collective.
            smooth_grad = prob * nc - 1.0 if w_local is None else prob * ctx.w_total - w_local
            gx = (1 - eps) * prob * w_t.unsqueeze(cdim) + (eps / nc) * smooth_grad * valid.unsqueeze(cdim)
            t = (target - ctx.start).unsqueeze(cdim)
            owned = valid.unsqueeze(cdim) & (t >= 0) & (t < n_local)
            gx = gx.scatter_add(cdim, t.clamp(0, n_local - 1), -(1 - eps) * w_t.unsqueeze(cdim) * owned)
        else:
            shifted, lse, wy, wy_sum, _ = ctx.saved_tensors
            prob = (shifted - lse.unsqueeze(cdim)).exp()
            gx = prob * wy_sum.unsqueeze(cdim) - wy
        gx = gx * (g.unsqueeze(cdim) if g.ndim else g)
        if call.target_kind is rules.TargetKind.CLASS_INDEX:
            # ignored rows get exactly 0, as in torch, even when a mean over no rows divides by 0
            gx = gx.masked_fill(~valid.unsqueeze(cdim), 0.0)
        return gx, None, None, None, None, None, None


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


def _reduce(t: torch.Tensor, op: ReduceOp, mesh: DeviceMesh) -> torch.Tensor:
    """``t`` reduced over the (1-D) vocab mesh, through the plan walker."""
    return reduce_over(t, mesh, (0,), op, C.COLLECTIVES)  # type: ignore[no-any-return]


def _log_softmax(x: DTensor, dim: int, half_to_float: bool) -> Any:
    local = x._local_tensor
    mesh = x.device_mesh
    row_max = _reduce(local.detach().amax(dim, keepdim=True), "max", mesh)
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
