"""Box transfer primitives of MindSpore (``TransferPrimitives``).

mccl (MindSpore's CPU collectives) has no point-to-point send or receive, so a box moves by a
broadcast from its holder inside the group of just the two ranks: the holder and the writer.  No
third rank takes part or holds any of the box, which keeps an export's "whole only on its writer"
bound.  The pair's group is created on demand by its two ranks (mccl creates a group on its members
only; other ranks never call it), at the pair's first transfer: every rank walks the transfers in
the same planned order, so both ends reach the creation together.  The broadcast is the collectives
module's, bit for bit for every dtype: on a world of two the pair is the world group (float32
native, other dtypes as the int32 words of their bytes); on a larger world a subgroup broadcast is
an all-reduce of the holder's values with ``-0.0`` (float32/float16, the box's bytes) or of one
float16 per byte (other dtypes, twice the box's bytes).  The rank, world size, object gather, spec
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
from hp_dtensor.platform import current
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
    def move_box(piece: Any, shape: Sequence[int], name: str, src: int, dst: int) -> Tensor | None:
        """A broadcast from ``src`` in the group of ``src`` and ``dst`` (both call it, no other rank)."""
        if src == dst:
            raise ValueError(f"move_box: a box moves between two ranks, got src == dst == {src}")
        plat = current()
        pair = (min(src, dst), max(src, dst))
        group = plat.get_or_create_group(pair)
        me = plat.get_rank()
        if me not in pair:
            raise ValueError(f"move_box: rank {me} is neither end of the transfer {src} -> {dst}")
        if me == src:
            if piece is None:
                raise ValueError(f"move_box: rank {src} sends but passed no piece")
            plat.COLLECTIVES.broadcast(_plain(piece), pair.index(src), group, 2, pair.index(me), src)
            return None
        # (the receiving end's buffer values are not used)
        out = plat.COLLECTIVES.broadcast(_MsTransfer.empty(shape, name), pair.index(src), group, 2, pair.index(me), src)
        return out  # type: ignore[no-any-return]


TRANSFER = _MsTransfer()
