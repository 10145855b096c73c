"""Vocab-parallel cross entropy on MindSpore: the kernel behind ``loss_parallel()``.

MindSpore's ``cross_entropy`` is composed in Python from some twenty primitives, so it is caught
whole, not op by op: inside ``loss_parallel()``, ``mindspore.ops.cross_entropy`` (which
``nn.CrossEntropyLoss`` calls) and ``mindspore.mint.nn.functional.cross_entropy`` send DTensor
logits to the framework-neutral kernel (``hp_tp.loss_parallel_kernel``: two all_reduces
forward, a local backward, torch's formula and errors) and plain tensors to MindSpore.  This
module supplies the kernel's MindSpore primitives and differentiable function.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mindspore as ms
from mindspore import Tensor, ops
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.dtensor import DTensor
from hp_tp import loss_parallel_kernel as kernel

_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


class _VocabParallelCrossEntropy(ms._Function):  # type: ignore[misc]
    """The kernel's forward and backward as a differentiable function of the local logits."""

    @staticmethod
    def forward(ctx: Any, x: Any, target: Any, weight: Any, fwd: Any, bwd: Any) -> Tensor:
        with NoFallbackGuard():
            out, ctx.saved = fwd(C._plain(x), target, weight)
        ctx.bwd = bwd
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        with NoFallbackGuard():
            return ctx.bwd(ctx.saved, C._plain(grad)), None, None, None, None


def _function(fwd: Callable[[Any, Any, Any], tuple[Any, Any]], bwd: Callable[[Any, Any], Any]) -> kernel.ApplyFn:
    return lambda x, target, weight: _VocabParallelCrossEntropy.apply(x, target, weight, fwd, bwd)


class _MindSporeLossMath:
    """``LossMath`` on MindSpore tensors."""

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, Tensor)

    def is_floating(self, t: Tensor) -> bool:
        return bool(t.is_floating_point())

    def is_bool(self, t: Tensor) -> bool:
        return bool(t.dtype == ms.bool_)

    def as_index(self, t: Tensor) -> Tensor:
        return t.astype(ms.int64)

    def requires_grad(self, t: Tensor) -> bool:
        # Gradients are taken by position (``value_and_grad``); a Parameter says whether it wants one.
        return bool(getattr(t, "requires_grad", False)) and isinstance(t, ms.Parameter)

    def shape(self, t: Tensor) -> tuple[int, ...]:
        return tuple(int(n) for n in Tensor.shape.fget(t))

    def detach(self, t: Tensor) -> Tensor:
        return ops.stop_gradient(t)

    def cast(self, t: Tensor, like: Tensor) -> Tensor:
        return t.astype(like.dtype)

    def amax(self, t: Tensor, dim: int) -> Tensor:
        shape = list(self.shape(t))
        if shape[dim] == 0 or 0 in shape:  # MindSpore's max refuses any empty input
            shape[dim] = 1
            return ops.full(tuple(shape), float("-inf"), dtype=t.dtype)
        return t.max(axis=dim, keepdims=True)

    def sum(self, t: Tensor, dim: int) -> Tensor:
        shape = list(self.shape(t))
        if 0 in shape:  # MindSpore's sum over no elements is not 0 (uninitialized memory)
            shape[dim] = 1
            return ops.zeros(tuple(shape), t.dtype)
        return t.sum(axis=dim, keepdims=True)

    def total(self, t: Tensor) -> Tensor:
        if 0 in self.shape(t):  # MindSpore's sum of an empty tensor reads uninitialized memory
            return ops.zeros((), t.dtype)
        return t.sum()

    def exp(self, t: Tensor) -> Tensor:
        return ops.exp(t)

    def log(self, t: Tensor) -> Tensor:
        return ops.log(t)

    def logical_and(self, a: Tensor, b: Tensor) -> Tensor:
        return ops.logical_and(a, b)

    def logical_or(self, a: Tensor, b: Tensor) -> Tensor:
        return ops.logical_or(a, b)

    def where(self, cond: Tensor, t: Tensor, other: float) -> Tensor:
        return ops.masked_fill(t, ops.logical_not(cond), ops.cast(Tensor(other), t.dtype))

    def clamp(self, t: Tensor, low: int, high: int) -> Tensor:
        return ops.clamp(t, low, high)

    def full(self, like: Tensor, n: int, value: float) -> Tensor:
        return ops.full((n,), value, dtype=like.dtype)

    def cat(self, ts: list[Tensor], dim: int) -> Tensor:
        return ops.cat(ts, dim)

    def unbind(self, t: Tensor, dim: int) -> tuple[Tensor, ...]:
        return tuple(ops.unbind(t, dim))

    def unsqueeze(self, t: Tensor, dim: int) -> Tensor:
        return t.unsqueeze(dim)

    def reshape(self, t: Tensor, shape: tuple[int, ...]) -> Tensor:
        return t.reshape(shape)

    def narrow(self, t: Tensor, dim: int, start: int, length: int) -> Tensor:
        # ``narrow`` refuses a start at the end even for length 0 (an empty vocab slice).
        index = [slice(None)] * len(self.shape(t))
        index[dim] = slice(start, start + length)
        return t[tuple(index)]

    def gather(self, t: Tensor, dim: int, index: Tensor) -> Tensor:
        return ops.gather_elements(t, dim, index.astype(ms.int64))

    def scatter_add(self, t: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
        return ops.tensor_scatter_elements(t, index.astype(ms.int64), src, dim, "add")

    def take(self, t: Tensor, index: Tensor) -> Tensor:
        return ops.gather(t, index.reshape(-1).astype(ms.int64), 0).reshape(self.shape(index))

    def first_value(self, t: Tensor, mask: Tensor) -> int | None:
        # in numpy: MindSpore's ``any`` of an empty tensor is True
        picked = t.asnumpy()[mask.asnumpy()].reshape(-1)
        return int(picked[0]) if picked.size else None


_MATH = _MindSporeLossMath()


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
            return cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)
        return original(input, target, weight, ignore_index, reduction, label_smoothing)

    return cross_entropy_routed


def cross_entropy(input: DTensor, target: Any, weight: Any = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> DTensor:
    """torch's ``cross_entropy`` for class-sharded DTensor logits (see the kernel's doc)."""
    return kernel.cross_entropy(  # type: ignore[no-any-return]
        _MATH, C.COLLECTIVES, _function, input, target, weight, ignore_index, reduction, label_smoothing
    )
