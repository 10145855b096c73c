"""What gradient-norm clipping needs from a framework, reached as ``platform.current().GRAD_NORM``.

The backend computes on local tensors (per-tensor norms, the total, in-place scaling); which
shards belong to one tensor and which mesh dims a partial norm is reduced over is decided in
``hp_fsdp.clip_grad``, and the reduction itself goes through the DTensor API.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from hp_dtensor.platform import current as _platform

Tensor = Any  # the framework's tensor type


class GradNormPrimitives(Protocol):
    def no_grad(self) -> AbstractContextManager[Any]: ...
    def is_tensor(self, x: Any) -> bool: ...
    def is_dtensor(self, x: Any) -> bool: ...
    def local_of(self, t: Tensor) -> Tensor: ...
    def grad_of(self, param: Tensor) -> Tensor | None: ...
    def describe(self, t: Tensor) -> str: ...
    def is_floating(self, t: Tensor) -> bool: ...
    def partials(self, tensors: Sequence[Tensor], p: float, foreach: bool | None) -> Tensor: ...
    def total(self, parts: Sequence[Tensor], p: float, tensors: Sequence[Tensor]) -> Tensor: ...
    def zero_norm(self) -> Tensor: ...
    def is_finite(self, total: Tensor) -> bool: ...
    def scale_(self, tensors: Sequence[Tensor], max_norm: float, total: Tensor, foreach: bool | None) -> None: ...


def grad_norm_primitives() -> GradNormPrimitives:
    prims: GradNormPrimitives | None = getattr(_platform(), "GRAD_NORM", None)
    if prims is None:
        raise NotImplementedError(
            f"clip_grad_norm_ is not supported on the {_platform().NAME} backend yet; "
            f"use the torch backend (HYPER_PARALLEL_PLATFORM=torch)"
        )
    return prims
