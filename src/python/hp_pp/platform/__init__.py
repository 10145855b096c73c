"""Pipeline parallelism's framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``PP`` (``PPPrimitives`` below): autograd on a stage's
forward and backward, point-to-point transfers with asynchronous handles, and the channel a
failing rank uses to stop the others.  The schedules, the runner and the layer splits are
framework-neutral.  A framework without a folder here (MindSpore, for now) gets
``NotImplementedError`` naming pipeline parallelism and the framework it runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from hp_dtensor.platform import package_backend

Tensor = Any  # the framework's tensor
Handle = Any  # an asynchronous P2P operation's handle


class PPPrimitives(Protocol):
    def split(self, value: Tensor, n: int) -> list[Tensor]:
        """``n`` chunks along dim 0 (``torch.tensor_split`` semantics)."""
        ...

    def is_tensor(self, value: object) -> bool: ...

    def as_stage_input(self, value: Tensor) -> Tensor:
        """A leaf that records the gradient of the stage's input (detached, requires grad when floating)."""
        ...

    def forward(self, module: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any: ...

    def backward(self, output: Tensor, grad: Tensor | None, inputs: Sequence[Tensor]) -> list[Tensor | None]:
        """Backward from ``output`` (a scalar loss when ``grad`` is None); accumulates the
        parameters' ``.grad`` and returns the gradients of ``inputs``."""
        ...

    def backward_input(self, output: Tensor, grad: Tensor | None, inputs: Sequence[Tensor]) -> list[Tensor | None]:
        """Only the gradients of ``inputs``; the graph is kept for ``backward_weight``."""
        ...

    def backward_weight(self, output: Tensor, grad: Tensor | None, params: Sequence[Any]) -> None:
        """Accumulate the gradients of ``params``; frees the graph."""
        ...

    def scale(self, loss: Tensor, factor: float) -> Tensor: ...

    def loss_value(self, loss: Tensor) -> Any:
        """The loss as a detached tensor to hand back to the caller."""
        ...

    def all_finite(self, value: Tensor) -> bool: ...

    def trainable_params(self, module: Any) -> list[Any]: ...

    def local_grad(self, param: Any) -> Tensor | None:
        """The rank's local gradient tensor of ``param`` (a DTensor's local shard), or None."""
        ...

    def describe(self, value: Tensor) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name)."""
        ...

    def isend(self, value: Tensor, peer: int, group: Any, tag: int, kind: str = ...) -> Handle: ...

    def irecv(self, shape: Sequence[int], dtype: str, peer: int, group: Any, tag: int,
              kind: str = ...) -> tuple[Tensor, Handle]: ...

    def send_shape(self, shape: Sequence[int], dtype: str, peer: int, group: Any, tag: int) -> Handle: ...

    def recv_shape(self, peer: int, group: Any, tag: int) -> tuple[Any, Handle, Callable[[Any], tuple[tuple[int, ...], str]]]: ...

    def watch(self, handle: Handle) -> Completion:
        """Start waiting for ``handle`` in the background; the caller polls the completion."""
        ...

    def abandon(self) -> None:
        """Give up the waits in flight (a peer failed and will not send)."""
        ...

    def abort_channel(self) -> AbortChannel: ...

    def agree(self, ok: bool, group: Any) -> bool:
        """True when ``ok`` on every rank of ``group`` (one small all-reduce)."""
        ...

    def add_(self, target: Tensor, other: Tensor) -> None: ...

    def copy_(self, target: Tensor, source: Tensor) -> None: ...

    def zeros_like(self, value: Tensor) -> Tensor: ...

    def all_gather_object(self, obj: object, group: Any) -> list[Any]: ...


class Completion(Protocol):
    def wait(self, timeout_s: float) -> bool:
        """True once the operation finished (successfully or not) within ``timeout_s``."""
        ...

    def result(self) -> None:
        """Raise the operation's error, if it failed."""
        ...


class AbortChannel(Protocol):
    """A key-value side channel every rank reaches without the pipeline's P2P (the rendezvous store)."""

    def post(self, key: str, message: str) -> None: ...

    def read(self, key: str) -> str | None: ...


def current() -> PPPrimitives:
    """The selected framework's primitives; ``NotImplementedError`` where hp_pp has none."""
    module = package_backend("hp_pp", "pipeline parallelism (hp_pp)")
    return cast(PPPrimitives, module.PP)
