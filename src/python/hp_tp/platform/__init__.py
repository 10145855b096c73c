"""Tensor parallelism's framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``loss_parallel`` (the context that routes cross entropy on
vocab-sharded logits to ``hp_tp.loss_parallel_kernel``) and may export ``local_layers`` (the
framework's local Linear/Embedding kernels, ``hp_tp.local_forward``); the styles themselves are
framework-neutral.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

from hp_dtensor.platform import package_backend


class TPBackend(Protocol):
    def loss_parallel(self) -> AbstractContextManager[None]: ...


def current() -> TPBackend:
    return cast(TPBackend, package_backend("hp_tp", "loss_parallel"))


def local_layers() -> Any | None:
    """The framework's local layer kernels, or None where it has none (the DTensor forward runs)."""
    return getattr(current(), "local_layers", None)
