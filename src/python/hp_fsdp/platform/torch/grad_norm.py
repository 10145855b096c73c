"""The tensor arithmetic of gradient-norm clipping, for torch.

``hp_fsdp.clip_grad`` decides which shards share a norm and which mesh dims to reduce over; this
file only computes on local tensors: per-tensor norms (torch's own ``_foreach_norm`` /
``vector_norm`` kernels, so precision and dtypes follow torch), the total, and the in-place
scaling.  Per-tensor partial values are float64 so that combining shards adds no rounding of its
own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from hp_dtensor.platform.torch.dtensor import DTensor


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's rule: None picks foreach where the device supports it; True insists on it."""
    if (foreach is None and _has_foreach_support(tensors, device)) or (
        foreach and _device_has_foreach_support(device)
    ):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def _identity(p: float) -> float:
    """The partial value of an empty shard: neutral for the combine of ``p``."""
    return math.inf if p == -math.inf else 0.0


class _TorchGradNorm:
    """``GradNormPrimitives`` of torch."""

    @staticmethod
    def no_grad() -> AbstractContextManager[Any]:
        return torch.no_grad()

    @staticmethod
    def is_tensor(x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    @staticmethod
    def is_dtensor(x: Any) -> bool:
        return isinstance(x, DTensor)

    @staticmethod
    def local_of(t: Any) -> torch.Tensor:
        """The tensor whose elements this rank holds (a DTensor's shard, shared, not a copy)."""
        return t._local_tensor if isinstance(t, DTensor) else t

    @staticmethod
    def grad_of(param: Any) -> Any:
        return param.grad

    @staticmethod
    def describe(t: Any) -> str:
        return f"{type(t).__name__} of shape {tuple(t.shape)} and dtype {t.dtype}"

    @staticmethod
    def is_floating(t: torch.Tensor) -> bool:
        return t.is_floating_point() or t.is_complex()

    @staticmethod
    def partials(tensors: Sequence[torch.Tensor], p: float, foreach: bool | None) -> torch.Tensor:
        """One float64 value per tensor that sums (finite ``p``: ``norm**p``, ``p == 0``: the
        nonzero count) or maxes/mins (``p = +-inf``: the norm) across the shards of one tensor.

        Empty shards (uneven sharding) give the identity instead of a norm: torch refuses the
        inf norms of an empty tensor."""
        tensors = list(tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        out = torch.full((len(tensors),), _identity(p), dtype=torch.float64, device=device)
        live = [i for i, t in enumerate(tensors) if t.numel() > 0]
        if not live:
            return out
        grouped = _group_tensors_by_device_and_dtype([[tensors[i] for i in live]], with_indices=True)
        for (dev, _), ([group], idx) in grouped.items():
            ts = [t for t in group if t is not None]
            where = [live[i] for i in idx]
            if _use_foreach(ts, dev, foreach):
                norms = list(torch._foreach_norm(ts, p))
            else:
                norms = [torch.linalg.vector_norm(t, p) for t in ts]
            values = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
            if math.isfinite(p) and p != 0:
                values = values.pow(p)
            out[torch.tensor(where, dtype=torch.long, device=device)] = values
        return out

    @staticmethod
    def total(parts: Sequence[torch.Tensor], p: float, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The norm of the per-tensor norms from ``partials`` (reduced across shards), as torch's
        ``get_total_norm`` returns it: a 0-d tensor of the promoted (real) dtype of ``tensors``."""
        device = parts[0].device
        v = torch.cat([x.to(device) for x in parts])
        if p == math.inf:
            t = v.max()
        elif p == -math.inf:
            t = v.min()
        elif p == 0:
            t = (v != 0).sum().to(torch.float64)  # torch: the 0-"norm" of the per-tensor counts
        else:
            t = v.sum().pow(1.0 / p)
        dtype = tensors[0].dtype
        for x in tensors[1:]:
            dtype = torch.promote_types(dtype, x.dtype)
        if dtype.is_complex:
            dtype = dtype.to_real()
        return t.to(dtype)

    @staticmethod
    def zero_norm() -> torch.Tensor:
        return torch.tensor(0.0)

    @staticmethod
    def is_finite(total: torch.Tensor) -> bool:
        return bool(torch.isfinite(total))

    @staticmethod
    def scale_(tensors: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None) -> None:
        """``t *= min(max_norm / (total + 1e-6), 1)`` in place, computed as torch does (no branch
        on the value, so no device sync)."""
        live: list[torch.Tensor | None] = [t for t in tensors if t.numel() > 0]
        if not live:
            return
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grouped = _group_tensors_by_device_and_dtype([live])
        for (dev, _), ([group], _) in grouped.items():
            ts = [t for t in group if t is not None]
            c = coef.to(dev)
            if _use_foreach(ts, dev, foreach):
                torch._foreach_mul_(ts, c)
            else:
                for t in ts:
                    t.mul_(c)

    @staticmethod
    def scaled(tensors: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor) -> list[torch.Tensor]:
        """New tensors ``t * min(max_norm / (total + 1e-6), 1)`` (``clip_grads``, out of place)."""
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return [t * coef.to(device=t.device, dtype=t.dtype) for t in tensors]


GRAD_NORM = _TorchGradNorm()

__all__ = ["GRAD_NORM"]
