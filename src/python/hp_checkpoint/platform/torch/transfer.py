"""Box transfer primitives of torch (``TransferPrimitives``): boxes move point to point.

Sends and receives go over the default (world) process group with global ranks, blocking, and are
recorded in ``CommDebugMode`` (each transfer once, as a ``send``).  The
rank, world size, object gather, spec and shape are the neutral ``TransferBase``.  dtype names
are the framework-neutral lowercase names (``float32``, ``bfloat16``...), the same MindSpore uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_checkpoint.gather_to_rank import TransferBase
from hp_dtensor.comm_debug import record
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


class _TorchTransfer(TransferBase):
    @staticmethod
    def local_of(t: Any) -> torch.Tensor:
        return (t._local_tensor if isinstance(t, DTensor) else t).detach()

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
    def move_box(piece: torch.Tensor | None, shape: Sequence[int], name: str, src: int, dst: int) -> torch.Tensor | None:
        """Point to point: ``src`` sends, ``dst`` receives into a new tensor."""
        if piece is not None:
            piece = piece.detach().contiguous()
            record("send", piece.numel() * piece.element_size())
            dist.send(piece, dst)
            return None
        out = torch.empty(tuple(shape), dtype=to_dtype(name))
        dist.recv(out, src)
        return out


TRANSFER = _TorchTransfer()
