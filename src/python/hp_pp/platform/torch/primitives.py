"""Autograd, point-to-point transfers and the abort channel of a pipeline stage on torch.

Transfers are ``torch.distributed.isend`` / ``irecv`` on the pp group with a tag per (direction,
stage, microbatch), so messages between two ranks match by tag whatever order they are posted in.
Each records itself in ``CommDebugMode`` as ``send`` / ``recv`` (shape messages as ``send_shape``
/ ``recv_shape``).  The abort channel is the default group's rendezvous store.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor import DTensor
from hp_dtensor.comm_debug import record

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}
_CODES = {name: i for i, name in enumerate(_DTYPES)}
_MAX_DIMS = 8


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Store:
    def __init__(self, store: Any) -> None:
        self._store = store

    def post(self, key: str, message: str) -> None:
        self._store.set(key, message)

    def read(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode("utf-8", "replace")


class _Completion:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)

    def result(self) -> None:
        if self._error is not None:
            raise self._error


def _wait_loop(q: queue.SimpleQueue[Any]) -> None:
    while True:
        work, done = q.get()
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits on it)
            done._error = e
        done._event.set()


class TorchPP:
    def __init__(self) -> None:
        self._waiter: threading.Thread | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._abandoned = False

    def split(self, value: torch.Tensor, n: int) -> list[torch.Tensor]:
        return list(torch.tensor_split(value, n, dim=0))

    def is_tensor(self, value: object) -> bool:
        return isinstance(value, torch.Tensor)

    def as_stage_input(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach()
        if out.is_floating_point():
            out.requires_grad_(True)
        return out

    def forward(self, module: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return module(*args, **kwargs)

    def backward(self, output: torch.Tensor, grad: torch.Tensor | None,
                 inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        wanted = [t for t in inputs if t.requires_grad]
        for t in wanted:
            t.grad = None
        torch.autograd.backward(output, grad_tensors=grad)
        return [t.grad if t.requires_grad else None for t in inputs]

    def backward_input(self, output: torch.Tensor, grad: torch.Tensor | None,
                       inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        wanted = [t for t in inputs if t.requires_grad]
        if not wanted:
            return [None for _ in inputs]
        grads = iter(torch.autograd.grad(output, wanted, grad_outputs=grad, retain_graph=True, allow_unused=True))
        return [next(grads) if t.requires_grad else None for t in inputs]

    def backward_weight(self, output: torch.Tensor, grad: torch.Tensor | None, params: Sequence[Any]) -> None:
        used = [p for p in params if p.requires_grad]
        if used:
            torch.autograd.backward(output, grad_tensors=grad, inputs=used)

    def scale(self, loss: torch.Tensor, factor: float) -> torch.Tensor:
        return loss if factor == 1.0 else loss * factor

    def loss_value(self, loss: torch.Tensor) -> torch.Tensor:
        value = loss.detach()
        return value.full_tensor() if isinstance(value, DTensor) else value  # type: ignore[no-any-return]

    def all_finite(self, value: torch.Tensor) -> bool:
        local = value.to_local() if isinstance(value, DTensor) else value
        return bool(torch.isfinite(local.detach()).all())

    def trainable_params(self, module: Any) -> list[Any]:
        return [p for p in module.parameters() if p.requires_grad]

    def local_grad(self, param: Any) -> torch.Tensor | None:
        grad = param.grad
        if grad is None:
            return None
        return grad.to_local() if isinstance(grad, DTensor) else grad  # type: ignore[no-any-return]

    def describe(self, value: torch.Tensor) -> tuple[tuple[int, ...], str]:
        return tuple(value.shape), _name(value.dtype)

    def isend(self, value: torch.Tensor, peer: int, group: Any, tag: int, kind: str = "send") -> Any:
        value = value.detach().contiguous()
        record(kind, value.numel() * value.element_size(), 2)
        return (dist.isend(value, dst=peer, group=group, tag=tag), value)

    def irecv(self, shape: Sequence[int], dtype: str, peer: int, group: Any, tag: int,
              kind: str = "recv") -> tuple[torch.Tensor, Any]:
        buf = torch.empty(tuple(shape), dtype=_DTYPES[dtype])
        record(kind, buf.numel() * buf.element_size(), 2)
        return buf, (dist.irecv(buf, src=peer, group=group, tag=tag), buf)

    def send_shape(self, shape: Sequence[int], dtype: str, peer: int, group: Any, tag: int) -> Any:
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"a pipeline activation has {len(shape)} dims; at most {_MAX_DIMS} are supported")
        if dtype not in _CODES:
            raise TypeError(f"a pipeline activation of dtype {dtype} cannot be sent; use one of {sorted(_CODES)}")
        meta = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
        meta[0], meta[1] = len(shape), _CODES[dtype]
        meta[2:2 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
        record("send_shape", meta.numel() * 8, 2)
        return (dist.isend(meta, dst=peer, group=group, tag=tag), meta)

    def recv_shape(self, peer: int, group: Any, tag: int
                   ) -> tuple[Any, Any, Callable[[Any], tuple[tuple[int, ...], str]]]:
        meta = torch.empty(_MAX_DIMS + 2, dtype=torch.int64)
        record("recv_shape", meta.numel() * 8, 2)
        names = list(_DTYPES)

        def decode(m: torch.Tensor) -> tuple[tuple[int, ...], str]:
            n = int(m[0])
            return tuple(int(x) for x in m[2:2 + n]), names[int(m[1])]

        return meta, (dist.irecv(meta, src=peer, group=group, tag=tag), meta), decode

    def watch(self, handle: Any) -> _Completion:
        """A completion the caller can wait on with a timeout: gloo's P2P handles have no
        completion flag (``is_completed`` stays False until ``wait``) and a timed-out ``wait``
        leaves them unusable, so one background thread makes the blocking ``wait`` calls, in the
        order they are asked for."""
        done = _Completion()
        if self._waiter is None or not self._waiter.is_alive() or self._abandoned:
            self._abandoned = False
            self._queue = queue.SimpleQueue()
            self._waiter = threading.Thread(target=_wait_loop, args=(self._queue,), daemon=True,
                                            name="hp_pp-p2p-wait")
            self._waiter.start()
        self._queue.put((handle[0], done))
        return done

    def abandon(self) -> None:
        """Forget the waits in flight (their peer failed): later waits go to a fresh thread."""
        self._abandoned = True

    def abort_channel(self) -> _Store:
        from torch.distributed.distributed_c10d import _get_default_store

        return _Store(_get_default_store())

    def agree(self, ok: bool, group: Any) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item() == 1)

    def add_(self, target: torch.Tensor, other: torch.Tensor) -> None:
        with torch.no_grad():
            target.add_(other)

    def copy_(self, target: torch.Tensor, source: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(source)

    def zeros_like(self, value: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(value)

    def all_gather_object(self, obj: object, group: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out


PP = TorchPP()
