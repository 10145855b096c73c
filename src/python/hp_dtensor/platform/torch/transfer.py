"""Point-to-point box transfer primitives of torch (``TransferPrimitives``).

Sends and receives go over the default (world) process group with global ranks and are recorded
in ``CommDebugMode`` (each transfer once, as a ``send``); outside a process group the world is one rank.  dtype names are the
framework-neutral lowercase names (``float32``, ``bfloat16``...), the same MindSpore uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.comm_debug import record
from hp_dtensor.dtensor_spec import DTensorSpec
from hp_dtensor.platform.torch.dtensor import DTensor

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def to_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} has no checkpoint name; supported: {sorted(_DTYPES)}")
    return _NAMES[dtype]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _TorchTransfer:
    @staticmethod
    def rank() -> int:
        return dist.get_rank() if _distributed() else 0

    @staticmethod
    def world_size() -> int:
        return dist.get_world_size() if _distributed() else 1

    @staticmethod
    def all_gather_object(obj: Any) -> list[Any]:
        if not _distributed():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        record("all_gather_object", 0, dist.get_world_size())
        dist.all_gather_object(out, obj)
        return out

    @staticmethod
    def barrier() -> None:
        if _distributed():
            dist.barrier()

    @staticmethod
    def spec_of(t: Any) -> DTensorSpec | None:
        return t._spec if isinstance(t, DTensor) else None

    @staticmethod
    def local_of(t: Any) -> torch.Tensor:
        return (t._local_tensor if isinstance(t, DTensor) else t).detach()

    @staticmethod
    def shape_of(t: Any) -> tuple[int, ...]:
        return tuple(int(n) for n in t.shape)

    @staticmethod
    def dtype_name(t: Any) -> str:
        return dtype_name(t.dtype)

    @staticmethod
    def itemsize(name: str) -> int:
        return to_dtype(name).itemsize

    @staticmethod
    def empty(shape: Sequence[int], name: str) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=to_dtype(name))

    @staticmethod
    def put_box(buf: torch.Tensor, offsets: Sequence[int], piece: torch.Tensor) -> None:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
        with torch.no_grad():
            buf[index].copy_(piece)

    @staticmethod
    def send(t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        record("send", t.numel() * t.element_size())
        dist.send(t, dst)

    @staticmethod
    def recv(shape: Sequence[int], name: str, src: int) -> torch.Tensor:
        out = torch.empty(tuple(shape), dtype=to_dtype(name))
        dist.recv(out, src)
        return out


TRANSFER = _TorchTransfer()
