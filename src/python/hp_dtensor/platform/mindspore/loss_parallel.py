"""Vocab-parallel cross entropy on MindSpore: the kernel behind ``loss_parallel()``.

MindSpore's ``cross_entropy`` is composed in Python from some twenty primitives, so it is caught
whole, not op by op: inside ``loss_parallel()``, ``mindspore.ops.cross_entropy`` (which
``nn.CrossEntropyLoss`` calls) and ``mindspore.mint.nn.functional.cross_entropy`` send DTensor
logits here and plain tensors to MindSpore.  Logits whose class dim (dim 1, or 0 for 1-D logits)
is ``Shard`` on one mesh dim (``Replicate`` elsewhere) are never gathered: the row max (detached;
the shift cancels in the gradient) and the row sum of exp are reduced across that mesh dim, each
rank picks the targets in its vocab slice, and one more sum assembles them.  Every rank computes
the same (replicated) loss from those sums, so the picked sum needs no backward collective; the
sum of exp feeds each rank's own slice, so backward sums its gradient once.  The result is the torch
formula -- ``weight``, ``ignore_index``, ``reduction``, ``label_smoothing``, any trailing dims --
returned as a replicated DTensor.  Other layouts are gathered and computed by MindSpore (correct).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mindspore as ms
from mindspore import Tensor, ops
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor_spec import DTensorSpec
from hp_dtensor.placement_types import ReduceOp, Replicate, Shard
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.dtensor import DTensor
from hp_dtensor.redistribute_exec import reduce_over

_REDUCTIONS = ("mean", "sum", "none")
_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


class _SumAcross(ms._Function):  # type: ignore[misc]
    """all_reduce(sum) forward over one mesh dim's group.  Backward: identity when the sum feeds
    only replicated computation (every rank then holds the whole gradient), a sum of the ranks'
    gradients when it feeds each rank's own vocab slice (each holds one term)."""

    @staticmethod
    def forward(ctx: Any, local: Any, mesh: DeviceMesh, k: int, grad_sum: bool) -> Tensor:
        ctx.meta = (mesh, k, grad_sum)
        with NoFallbackGuard():
            out = _reduce_over(local, "sum", mesh, k)
            return out if mesh.shape[k] > 1 else ops.deepcopy(out)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        mesh, k, grad_sum = ctx.meta
        if grad_sum:
            with NoFallbackGuard():
                grad = _reduce_over(grad, "sum", mesh, k)
        return grad, None, None, None


def _reduce_over(t: Any, op: ReduceOp, mesh: DeviceMesh, k: int) -> Tensor:
    """``t`` reduced over mesh dim ``k`` (the vocab shards), through the plan walker."""
    return reduce_over(C._plain(t), mesh, (k,), op, C.COLLECTIVES)  # type: ignore[no-any-return]


def _targets() -> list[tuple[Any, str]]:
    from mindspore import mint

    return [(ops, "cross_entropy"), (mint.nn.functional, "cross_entropy")]


@contextmanager
def loss_parallel() -> Iterator[None]:
    """Route MindSpore's ``cross_entropy`` on DTensor logits to the vocab-parallel kernel."""
    global _depth
    with _lock:
        if _depth == 0:
            for owner, name in _targets():
                original = getattr(owner, name)
                _saved.append((owner, name, original))
                setattr(owner, name, _routed(original))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _saved:
                    owner, name, original = _saved.pop()
                    setattr(owner, name, original)


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
    def cross_entropy_routed(input: Any, target: Any, weight: Any = None, ignore_index: int = -100,
                             reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
        if isinstance(input, DTensor):
            return cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, original)
        return original(input, target, weight, ignore_index, reduction, label_smoothing)

    return cross_entropy_routed


def _local(x: Any) -> Any:
    """A DTensor argument other than the logits (target, weight) as its whole plain value."""
    if isinstance(x, DTensor):
        return x.full_tensor() if any(not p.is_replicate() for p in x.placements) else x.to_local()
    return x


def _check(input: DTensor, target: Any, weight: Any, reduction: str, label_smoothing: float) -> int:
    """Validate like torch's cross_entropy (same inputs on every rank, so every rank raises alike);
    returns the class dim."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if input.ndim == 0:
        raise ValueError("cross_entropy: logits must have a class dim, got a 0-d DTensor")
    if not isinstance(target, Tensor):
        raise TypeError(f"cross_entropy: target must be a Tensor, got {type(target).__name__}")
    if target.is_floating_point():
        raise NotImplementedError(
            "loss_parallel supports class-index targets only; class-probability targets "
            "(floating-point target) need the whole vocab on one rank"
        )
    class_dim = 0 if input.ndim == 1 else 1
    want = tuple(s for d, s in enumerate(input.shape) if d != class_dim)
    if tuple(target.shape) != want:
        raise ValueError(
            f"cross_entropy: target shape {tuple(target.shape)} does not match logits {tuple(input.shape)} "
            f"without the class dim {class_dim} (expected {want})"
        )
    if weight is not None and tuple(weight.shape) != (input.shape[class_dim],):
        raise ValueError(
            f"cross_entropy: weight must have shape ({input.shape[class_dim]},) (one per class), "
            f"got {tuple(weight.shape)}"
        )
    return class_dim


def _vocab_mesh_dim(x: DTensor, class_dim: int) -> int | None:
    """The mesh dim sharding the class dim when every other mesh dim replicates, else None."""
    shard = [k for k, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim % x.ndim == class_dim]
    others = [p for k, p in enumerate(x.placements) if k not in shard]
    if len(shard) == 1 and all(isinstance(p, Replicate) for p in others):
        return shard[0]
    return None


def cross_entropy(input: DTensor, target: Any, weight: Any = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0,
                  original: Callable[..., Any] | None = None) -> DTensor:
    """torch's ``cross_entropy`` on class-index targets, for DTensor logits (see module doc)."""
    target, weight = _local(target), _local(weight)
    class_dim = _check(input, target, weight, reduction, label_smoothing)
    mesh = input.device_mesh
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    k = _vocab_mesh_dim(input, class_dim)
    n_classes = int(input.shape[class_dim])
    valid = target != ignore_index
    bad = ops.logical_and(valid, ops.logical_or(target < 0, target >= n_classes))
    if bool(bad.any()):
        raise ValueError(
            f"cross_entropy: target holds class indices outside [0, {n_classes}) that are not "
            f"ignore_index ({ignore_index})"
        )
    if k is None:
        whole = input.redistribute(mesh, rep).to_local()
        fn = original if original is not None else ops.cross_entropy
        out = fn(whole, target, weight, ignore_index, reduction, label_smoothing)
        return DTensor(out, DTensorSpec(mesh, rep, tuple(out.shape)))

    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not part of {mesh}")
    n, index = mesh.shape[k], coord[k]
    x = input.to_local()
    width = int(Tensor.shape.fget(x)[class_dim])
    start = min(n_classes, index * -(-n_classes // n))  # torch.chunk's split: ceil(C / n) per rank
    row_max = _reduce_over(ops.stop_gradient(x.max(axis=class_dim, keepdims=True)), "max", mesh, k)
    shifted = x - row_max
    # Each rank's slice of log-probs depends on the total: its gradient arrives in per-rank terms.
    sum_exp = _SumAcross.apply(ops.exp(shifted).sum(axis=class_dim, keepdims=True), mesh, k, True)
    logp = shifted - ops.log(sum_exp)

    fdtype = x.dtype
    t_local = target - start
    owned = ops.logical_and(valid, ops.logical_and(t_local >= 0, t_local < width))
    idx = ops.select(owned, t_local, ops.zeros_like(t_local)).astype(ms.int64)
    picked = ops.gather_elements(logp, class_dim, idx.expand_dims(class_dim)).squeeze(class_dim)
    picked = _SumAcross.apply(picked * owned.astype(fdtype), mesh, k, False)
    valid_f = valid.astype(fdtype)
    if weight is not None:
        safe = ops.select(valid, target, ops.zeros_like(target)).astype(ms.int64)
        w_rows = ops.gather(weight.astype(fdtype), safe.reshape(-1), 0).reshape(tuple(target.shape)) * valid_f
    else:
        w_rows = valid_f
    nll_rows = -picked * w_rows
    loss = _reduce(nll_rows, w_rows, reduction)
    if label_smoothing > 0:
        if weight is not None:
            shape = [1] * x.ndim
            shape[class_dim] = width
            w_local = weight.astype(fdtype)[start:start + width].reshape(tuple(shape))
            smooth_local = (logp * w_local).sum(axis=class_dim)
        else:
            smooth_local = logp.sum(axis=class_dim)
        smooth_rows = -_SumAcross.apply(smooth_local, mesh, k, False) * valid_f
        smooth = _reduce(smooth_rows, w_rows, reduction)
        loss = loss * (1.0 - label_smoothing) + smooth * (label_smoothing / n_classes)
    return DTensor(loss, DTensorSpec(mesh, rep, tuple(Tensor.shape.fget(loss))))


def _reduce(rows: Tensor, w_rows: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / w_rows.sum()  # torch: normalized by the targets' total weight
