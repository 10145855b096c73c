"""Box transfer primitives of MindSpore (``TransferPrimitives``).

mccl on CPU has no point-to-point, so ``send``/``recv`` (gathering a tensor onto one rank) are
refused.  The rank, world size, object gather (the collectives module's, on the world group), spec
and shape are the neutral ``TransferBase``.  dtype names are the framework-neutral lowercase names
torch uses too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor

from hp_checkpoint.gather_to_rank import TransferBase
from hp_dtensor.platform.mindspore.collectives import _plain

_DTYPES: dict[str, Any] = {
    "float64": ms.float64, "float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16,
    "int64": ms.int64, "int32": ms.int32, "int16": ms.int16, "int8": ms.int8, "uint8": ms.uint8, "bool": ms.bool_,
}
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


def dtype_name(dtype: Any) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no checkpoint name; supported: {sorted(_DTYPES)}")


class _MsTransfer(TransferBase):
    @staticmethod
    def local_of(t: Any) -> Tensor:
        return _plain(t)

    @staticmethod
    def dtype_name(t: Any) -> str:
        return dtype_name(t.dtype)

    @staticmethod
    def itemsize(name: str) -> int:
        if name not in _ITEMSIZE:
            raise ValueError(f"dtype {name!r} is not one of {sorted(_ITEMSIZE)}")
        return _ITEMSIZE[name]

    @staticmethod
    def empty(shape: Sequence[int], name: str) -> Tensor:
        return Tensor(np.zeros(tuple(shape), np.float32)).astype(_DTYPES[name])

    @staticmethod
    def put_box(buf: Any, offsets: Sequence[int], piece: Any) -> None:
        """Copy ``piece`` into ``buf`` at ``offsets`` in place (``buf`` keeps its identity)."""
        target = _plain(buf)
        piece = piece if isinstance(piece, Tensor) else Tensor(piece)
        if not offsets:
            target.assign_value(piece.astype(target.dtype))
            return
        index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
        if target.dtype == ms.bfloat16:
            # MindSpore's CPU slice assignment has no bfloat16 kernel: assign in float32, which
            # holds every bfloat16 exactly, and cast back
            wide = target.astype(ms.float32)
            wide[index] = piece.astype(ms.float32)
            target.copy_(wide.astype(ms.bfloat16))  # in place: the storage the DTensor shares
            return
        target[index] = piece.astype(target.dtype)

    @staticmethod
    def send(t: Any, dst: int) -> None:
        raise NotImplementedError("gathering a tensor onto one rank needs point-to-point sends, which MindSpore's "
                                  "CPU collectives (mccl) lack; export on the torch backend")

    @staticmethod
    def recv(shape: Sequence[int], name: str, src: int) -> Tensor:
        raise NotImplementedError("gathering a tensor onto one rank needs point-to-point receives, which "
                                  "MindSpore's CPU collectives (mccl) lack; export on the torch backend")


TRANSFER = _MsTransfer()
