"""The tensor arithmetic of gradient-norm clipping, for MindSpore.

MindSpore parameters carry no ``.grad`` (``mindspore.value_and_grad`` returns the gradients), so
``clip_grad_norm_`` / ``clip_grads_with_norm_`` (which read and scale ``.grad`` in place) raise
``NotImplementedError``; ``clip_grads(grads, max_norm, parameters=...)`` and
``get_total_norm(grads)`` use this file.  Which shards share a norm and which mesh dims are
reduced is decided in ``hp_fsdp.clip_grad``; here, per-tensor partial values in float64 (so that
combining shards adds no rounding of its own), the total, and out-of-place scaling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NoReturn

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.dtensor import DTensor
from hp_dtensor.platform.mindspore.world import device_target

_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


def _identity(p: float) -> float:
    """The partial value of an empty shard: neutral for the combine of ``p``."""
    return math.inf if p == -math.inf else 0.0


def _partial_host(t: Tensor, p: float) -> float:
    """One shard's contribution, in float64: ``sum |x|^p`` (``p == 0``: the nonzero count; +-inf:
    the largest/smallest ``|x|``), by numpy, for a shard in host memory (the CPU target): one copy
    out of the runtime instead of five PyNative ops.  A cast to float64 is exact for every
    floating dtype; bfloat16, which numpy lacks, leaves through float32."""
    x = C._plain(t)
    a = np.abs((x.astype(ms.float32) if x.dtype == ms.bfloat16 else x).asnumpy().astype(np.float64)).reshape(-1)
    if p == math.inf:
        return float(a.max())
    if p == -math.inf:
        return float(a.min())
    if p == 0:
        return float(np.count_nonzero(a))
    if p == 1:
        return float(a.sum())
    return float((a**p).sum())


def _partial_device(t: Tensor, p: float) -> Tensor:
    """``_partial_host``'s value computed where the shard is (an accelerator): only the 0-d
    result leaves the device."""
    a = ops.abs(C._plain(t).astype(ms.float64)).reshape((-1,))
    if p == math.inf:
        return a.max()
    if p == -math.inf:
        return a.min()
    if p == 0:
        return (a != 0).astype(ms.float64).sum()
    if p == 1:
        return a.sum()
    return ops.pow(a, p).sum()


class _MindSporeGradNorm:
    """``GradNormPrimitives`` of MindSpore (PyNative)."""

    @staticmethod
    def no_grad() -> AbstractContextManager[Any]:
        return nullcontext()  # nothing records outside value_and_grad

    @staticmethod
    def is_tensor(x: Any) -> bool:
        return isinstance(x, Tensor)

    @staticmethod
    def is_dtensor(x: Any) -> bool:
        return isinstance(x, DTensor)

    @staticmethod
    def local_of(t: Any) -> Tensor:
        return C._plain(t)

    @staticmethod
    def grad_of(param: Any) -> NoReturn:
        raise NotImplementedError(
            "clip_grad_norm_ / clip_grads_with_norm_ read .grad, which MindSpore parameters do not hold: "
            "use hp_fsdp.clip_grads(grads, max_norm, parameters=params) on the gradients "
            "mindspore.value_and_grad returns"
        )

    @staticmethod
    def describe(t: Any) -> str:
        return f"{type(t).__name__} of shape {tuple(Tensor.shape.fget(t))} and dtype {t.dtype}"

    @staticmethod
    def is_floating(t: Any) -> bool:
        return t.dtype in _FLOATS

    @staticmethod
    def partials(tensors: Sequence[Any], p: float, foreach: bool | None) -> Tensor:
        """One float64 value per tensor that sums (finite ``p``) or maxes/mins (+-inf) across the
        shards of one tensor; an empty shard gives the identity."""
        if device_target() == "CPU":
            values = [_partial_host(t, p) if math.prod(Tensor.shape.fget(t)) > 0 else _identity(p) for t in tensors]
            return Tensor(np.array(values, dtype=np.float64))
        return ops.stack([
            _partial_device(t, p) if math.prod(Tensor.shape.fget(t)) > 0 else Tensor(_identity(p), ms.float64)
            for t in tensors
        ])

    @staticmethod
    def total(parts: Sequence[Tensor], p: float, tensors: Sequence[Any]) -> Tensor:
        """The norm of the per-tensor norms, a 0-d tensor of the widest dtype of ``tensors``."""
        v = np.concatenate([C._plain(x).asnumpy().reshape(-1) for x in parts])
        if p == math.inf:
            t = v.max()
        elif p == -math.inf:
            t = v.min()
        elif p == 0:
            t = float((v != 0).sum())
        else:
            t = v.sum() ** (1.0 / p)
        widest = max((x.dtype for x in tensors), key=lambda d: {ms.float64: 3, ms.float32: 2}.get(d, 1))
        return Tensor(np.float64(t)).astype(widest)

    @staticmethod
    def zero_norm() -> Tensor:
        return Tensor(0.0, ms.float32)

    @staticmethod
    def is_finite(total: Tensor) -> bool:
        return bool(np.isfinite(total.astype(ms.float64).asnumpy()))

    @staticmethod
    def scale_(tensors: Sequence[Any], max_norm: float, total: Tensor, foreach: bool | None) -> NoReturn:
        raise NotImplementedError(
            "in-place gradient scaling is not supported on MindSpore (tensors are not reliably updated "
            "in place): use hp_fsdp.clip_grads, which returns the clipped gradients"
        )

    @staticmethod
    def scaled(tensors: Sequence[Any], max_norm: float, total: Tensor) -> list[Tensor]:
        """New tensors ``t * min(max_norm / (total + 1e-6), 1)``, each in its own dtype.  The
        coefficient is computed in float64 by numpy, as torch clamps it: a NaN total gives NaN
        gradients (MindSpore's ``clamp`` and ``minimum`` return the bound for NaN, which would
        pass the gradients on unscaled)."""
        value = float(C._plain(total).astype(ms.float64).asnumpy())
        coef = Tensor(np.minimum(np.float64(max_norm) / (np.float64(value) + 1e-6), np.float64(1.0)))
        by_dtype: dict[Any, Tensor] = {}
        for t in tensors:
            if t.dtype not in by_dtype:
                by_dtype[t.dtype] = coef.astype(t.dtype)
        return [C._plain(t) * by_dtype[t.dtype] for t in tensors]


GRAD_NORM = _MindSporeGradNorm()

__all__ = ["GRAD_NORM"]
