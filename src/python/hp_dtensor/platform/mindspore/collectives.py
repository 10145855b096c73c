"""Collectives on local MindSpore tensors along one mesh dim (no autograd; callers give duals).

MindSpore's CPU backend (mccl) runs only AllReduce (sum, float32/float16) on any group, and
AllGather / Broadcast on the world group; AllGather refuses 1-byte and bfloat16 tensors and
Broadcast returns float16/float64 as float32 and int64 as int32.  Everything else is composed
here from those, so that every dtype moves bit for bit:

* gathers of float32/float16 on a subgroup: each rank writes its block into a buffer of ``-0.0``
  at its slot and the buffers are summed with AllReduce.  ``x + (-0.0) == x`` bit for bit for
  every x (signed zeros, NaN payloads, subnormals included), in any summation order, so the
  result is the exact concatenation;
* gathers of any other dtype move the tensor's bytes: on the world group as int32 words through
  AllGather (a copy), on a subgroup as one byte per float16 element (0..255, exact) through the
  same slot-and-sum AllReduce (twice the bytes);
* ``all_reduce`` of float32/float16 sums is the native AllReduce; every other reduction (other
  dtypes, max, min) gathers the exact values and reduces them locally in rank order, so every rank
  gets the same result and NaN propagates through max/min.  float64 sums in float64, integers in
  their own type, bfloat16 in float32 rounded once;
* ``reduce_scatter``: all_reduce, then the rank keeps its chunk (a ring all-reduce moves about
  twice the bytes of a native reduce-scatter);
* ``all_to_all``: all_gather along the source shard dim, then the rank keeps its chunk of the
  target dim (n times the bytes of a native all-to-all);
* ``broadcast``: on the world group native for float32, else the int32 words of the source's
  bytes; on a subgroup the gather encodings with only the source's value (others ``-0.0`` or
  zero bytes);
* ``barrier``: an AllReduce of one element.

On Ascend the native HCCL collectives are used.  ``CommDebugMode`` counts the logical collective
(a composed reduce_scatter counts as one reduce_scatter), with the bytes of the logical operation.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, ops
from mindspore.ops.auto_generate import contiguous as _contiguous_op

from hp_dtensor.comm_debug import record
from hp_dtensor.layout.shard_geometry import chunk_size_and_offset
from hp_dtensor.platform.mindspore import world as PG

_NATIVE_FLOATS = (ms.float32, ms.float16)


def _plain(t: Any) -> Tensor:
    """A plain Tensor sharing ``t``'s data (a DTensor is a Tensor subclass)."""
    return t if type(t) is Tensor else Tensor._make_subclass(Tensor, t)


def copy(t: Tensor) -> Tensor:
    """A new tensor with ``t``'s values (``ops.deepcopy`` has no bfloat16 CPU kernel; the float32
    round trip is exact for bfloat16)."""
    if t.dtype == ms.bfloat16:
        return t.astype(ms.float32).astype(ms.bfloat16)
    return ops.deepcopy(t)


def _nbytes(t: Tensor) -> int:
    """From the shape (``Tensor.size`` waits for the tensor's pending producer)."""
    return math.prod(_shape(t)) * int(t.itemsize)


def dense(t: Tensor) -> Tensor:
    """``t``'s values in contiguous memory, queued like any op: ``Tensor.contiguous()`` first asks
    the runtime whether ``t`` is contiguous, which waits for the pending ops that produce ``t``
    (PyNative runs asynchronously): a stall per call."""
    return _contiguous_op(t)


def _native() -> bool:
    return PG.device_target() != "CPU"


def _is_world(group: Any) -> bool:
    return bool(group == PG.world_group())


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(Tensor.shape.fget(t))


# ---------------------------------------------------------------- exact data movement on CPU
# ``np.require(..., requirements="C")``, not ``ascontiguousarray``: the latter makes a 0-d array
# 1-d, and a reduced scalar must stay 0-d.
def _to_numpy(t: Tensor) -> np.ndarray:
    """``t``'s values as a numpy array; bfloat16 (which numpy lacks) widens to float32 exactly."""
    if t.dtype == ms.bfloat16:
        return np.asarray(t.astype(ms.float32).asnumpy())
    return np.require(t.asnumpy(), requirements="C")


def _from_numpy(a: np.ndarray, dtype: Any) -> Tensor:
    out = Tensor(np.require(a, requirements="C"))
    return out if out.dtype == dtype else out.astype(dtype)


def _gather_bytes(raw: np.ndarray, group: Any, n: int, index: int) -> np.ndarray:
    """Every rank's ``raw`` (1-D uint8, same length on every rank) as rows of an (n, len) array."""
    nb = int(raw.size)
    if nb == 0:
        return np.zeros((n, 0), np.uint8)
    if _is_world(group):
        words = np.zeros(((nb + 3) // 4) * 4, np.uint8)
        words[:nb] = raw
        out = ops.AllGather(group=group)(Tensor(words.view(np.int32))).asnumpy()
        return np.ascontiguousarray(out).view(np.uint8).reshape(n, -1)[:, :nb]
    buf = np.zeros((n, nb), np.float16)
    buf[index] = raw
    summed = ops.AllReduce(group=group)(Tensor(buf)).asnumpy()
    return np.rint(summed).astype(np.uint8)


def _gather_numpy(a: np.ndarray, group: Any, n: int, index: int) -> np.ndarray:
    """Every rank's ``a`` stacked on a new dim 0, bit for bit."""
    a = np.require(a, requirements="C")
    rows = _gather_bytes(a.reshape(-1).view(np.uint8), group, n, index)
    return np.ascontiguousarray(rows).view(a.dtype).reshape((n,) + a.shape)


def _neg_zeros(shape: tuple[int, ...], dtype: Any) -> Tensor:
    """A buffer of ``-0.0``: the additive identity that keeps every value's bits (see module doc)."""
    return mint.neg(mint.zeros(shape, dtype=dtype))


def _stack_gather(t: Tensor, group: Any, n: int, index: int) -> Tensor:
    """Every rank's ``t`` stacked on a new dim 0, in group order, bit for bit."""
    if _native():
        return ops.AllGather(group=group)(t.reshape((1,) + _shape(t)))
    if t.dtype in _NATIVE_FLOATS:
        if _is_world(group):
            return ops.AllGather(group=group)(dense(t.reshape((1,) + _shape(t))))
        buf = _neg_zeros((n,) + _shape(t), t.dtype)
        buf[index] = t
        return ops.AllReduce(group=group)(buf)
    return _from_numpy(_gather_numpy(_to_numpy(t), group, n, index), t.dtype)


def _raw_all_gather0(t: Tensor, group: Any, n: int, index: int) -> Tensor:
    """Concatenate every rank's ``t`` along dim 0, in group order."""
    stacked = _stack_gather(t, group, n, index)
    shape = _shape(t)
    return stacked.reshape((n * shape[0],) + shape[1:])


def _reduce_rows(a: np.ndarray, op: str, n: int) -> np.ndarray:
    """Reduce the gathered rows ``a[0..n-1]`` in rank order (the same on every rank)."""
    if a.dtype == np.bool_:
        if op == "avg":
            raise TypeError("an 'avg' reduction of bool tensors is undefined; use sum, max or min")
        return np.asarray(a.all(axis=0) if op == "min" else a.any(axis=0))
    if op in ("sum", "avg"):
        total = a.sum(axis=0, dtype=a.dtype)
        if op == "sum":
            return np.asarray(total)
        if not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"an 'avg' reduction of {a.dtype} tensors is not exact; reduce with 'sum' and divide")
        return np.asarray(total / a.dtype.type(n))
    if op == "max":
        return np.asarray(a.max(axis=0))  # numpy's max/min propagate NaN
    if op == "min":
        return np.asarray(a.min(axis=0))
    raise ValueError(f"reduce op {op!r} is not one of sum, avg, max, min")


def _reduce_by_gather(t: Tensor, op: str, group: Any, n: int, index: int) -> Tensor:
    if t.dtype in _NATIVE_FLOATS:
        rows = _stack_gather(t, group, n, index).asnumpy()
    else:
        rows = _gather_numpy(_to_numpy(t), group, n, index)
    return _from_numpy(_reduce_rows(rows, op, n), t.dtype)


# ---------------------------------------------------------------- the collectives
def all_reduce(t: Any, op: str, group: Any, n: int, index: int) -> Tensor:
    t = _plain(t)
    if n == 1:
        return t
    record("all_reduce", _nbytes(t))
    if _native():
        if op == "avg":
            return ops.AllReduce(group=group)(t) / n
        return ops.AllReduce(op=op, group=group)(t)
    if op in ("sum", "avg") and t.dtype in _NATIVE_FLOATS:
        out = ops.AllReduce(group=group)(t)
        return out / n if op == "avg" else out
    return _reduce_by_gather(t, op, group, n, index)


def all_gather(t: Any, dim: int, group: Any, n: int, index: int) -> Tensor:
    """Concatenate every rank's ``t`` along ``dim`` in group order."""
    t = _plain(t)
    if n == 1:
        return t
    record("all_gather", _nbytes(t) * n)
    if t.ndim == 0:
        return _raw_all_gather0(t.reshape((1,)), group, n, index)
    if dim == 0:
        return _raw_all_gather0(t, group, n, index)
    moved = dense(mint.transpose(t, 0, dim))
    return dense(mint.transpose(_raw_all_gather0(moved, group, n, index), 0, dim))


def _chunk(t: Tensor, dim: int, n: int, index: int) -> Tensor:
    """Chunk ``index`` of ``dim`` split ``torch.chunk``-style into ``n`` (uneven sizes allowed:
    full chunks first, then a short one, then empty ones)."""
    length, start = chunk_size_and_offset(int(_shape(t)[dim]), n, index)
    return narrow(t, dim, start, length)


def narrow(t: Tensor, dim: int, start: int, length: int) -> Tensor:
    """A contiguous copy of ``t[..., start:start + length, ...]`` along ``dim`` (length may be 0)."""
    return dense(mint.narrow(t, dim, start, length))


def pad(t: Tensor, dim: int, size: int) -> Tensor:
    """``t`` with zeros appended along ``dim`` up to ``size`` (MindSpore's CPU backend has no
    ConstantPadND kernel: a concatenation with a zero block does the same, for every dtype)."""
    shape = list(_shape(t))
    extra = size - shape[dim]
    if extra < 0:
        raise ValueError(f"pad: dim {dim} of shape {tuple(shape)} is already larger than {size}")
    if extra == 0:
        return t
    shape[dim] = extra
    return mint.cat([t, mint.zeros(tuple(shape), dtype=t.dtype)], dim)


def reduce_scatter(t: Any, dim: int, op: str, group: Any, n: int, index: int) -> Tensor:
    """Reduce ``t`` over the group and keep this rank's chunk of ``dim``."""
    t = _plain(t)
    if n == 1:
        return t
    record("reduce_scatter", _nbytes(t))
    if _native() and op in ("sum", "max", "min"):
        moved = dense(mint.transpose(t, 0, dim)) if dim else t
        out = ops.ReduceScatter(op=op, group=group)(moved)
        return dense(mint.transpose(out, 0, dim)) if dim else out
    if op in ("sum", "avg") and (t.dtype in _NATIVE_FLOATS or _native()):
        full = ops.AllReduce(group=group)(t)
        if op == "avg":
            full = full / n
    else:
        full = _reduce_by_gather(t, op, group, n, index)
    return _chunk(full, dim, n, index)


def all_to_all(t: Any, split_dim: int, concat_dim: int, group: Any, n: int, index: int) -> Tensor:
    """Shard(concat_dim) -> Shard(split_dim): this rank ends with chunk ``index`` of ``split_dim``,
    concatenated over the ranks along ``concat_dim``."""
    t = _plain(t)
    if n == 1:
        return t
    record("all_to_all", _nbytes(t))
    if _native():
        return ops.AlltoAll(split_count=n, split_dim=split_dim, concat_dim=concat_dim, group=group)(dense(t))
    moved = dense(mint.transpose(t, 0, concat_dim)) if concat_dim else t
    gathered = _raw_all_gather0(moved, group, n, index)
    if concat_dim:
        gathered = dense(mint.transpose(gathered, 0, concat_dim))
    return _chunk(gathered, split_dim, n, index)


def broadcast(t: Any, src_index: int, group: Any, n: int, index: int, src_global_rank: int) -> Tensor:
    """Every rank gets the value of group-rank ``src_index`` (``t`` has the same shape and dtype on
    every rank)."""
    t = _plain(t)
    if n == 1:
        return t
    record("broadcast", _nbytes(t))
    if _native():
        return ops.Broadcast(src_global_rank, group=group)((dense(t),))[0]
    if t.dtype == ms.float32 and _is_world(group):
        return ops.Broadcast(src_global_rank, group=group)((dense(t),))[0]
    if t.dtype in _NATIVE_FLOATS and not _is_world(group):
        mine = t if index == src_index else _neg_zeros(_shape(t), t.dtype)
        return ops.AllReduce(group=group)(mine)
    a = _to_numpy(t)
    raw = a.reshape(-1).view(np.uint8)
    nb = int(raw.size)
    if nb == 0:
        return t
    if _is_world(group):
        words = np.zeros(((nb + 3) // 4) * 4, np.uint8)
        words[:nb] = raw
        out = ops.Broadcast(src_global_rank, group=group)((Tensor(words.view(np.int32)),))[0].asnumpy()
        got = np.ascontiguousarray(out).astype(np.int32).view(np.uint8)[:nb]
    else:
        buf = raw.astype(np.float16) if index == src_index else np.zeros(nb, np.float16)
        got = np.rint(ops.AllReduce(group=group)(Tensor(buf)).asnumpy()).astype(np.uint8)
    return _from_numpy(np.ascontiguousarray(got).view(a.dtype).reshape(a.shape), t.dtype)


def barrier(group: Any, n: int) -> None:
    if n == 1:
        return
    record("barrier", 4)
    out = ops.AllReduce(group=group)(mint.ones((1,), dtype=ms.float32))
    out.asnumpy()  # wait for it


def gather_int_table(table: np.ndarray, group: Any, n: int, index: int) -> np.ndarray:
    """Every rank's int64 ``table`` (the same shape on every rank) concatenated along rows in group
    order, exactly: how ranks compare metadata before trusting each other's tensors."""
    if n == 1:
        return table
    record("all_gather", int(table.nbytes) * n)
    rows = _gather_numpy(np.ascontiguousarray(table, np.int64), group, n, index)
    return rows.reshape((-1,) + table.shape[1:])


def all_gather_object(obj: Any, group: Any, n: int, index: int) -> list[Any]:
    """Every group member's picklable ``obj`` in group order: the pickles' lengths, then the
    pickles padded to the longest, through the exact byte gather (mccl has no object gather).
    Counted as one ``all_gather_object``, like torch's."""
    if n == 1:
        return [obj]
    raw = np.frombuffer(pickle.dumps(obj), np.uint8)
    record("all_gather_object", 0, n)
    sizes = _gather_numpy(np.asarray([raw.size], np.int64), group, n, index).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    rows = _gather_bytes(padded, group, n, index)
    return [pickle.loads(rows[r, : int(sizes[r])].tobytes()) for r in range(n)]


class _Collectives:
    """MindSpore's ``Collectives`` (the backend contract's one signature per collective),
    composed where the CPU backend lacks a native one."""

    chunk = staticmethod(_chunk)
    zeros_like = staticmethod(ops.zeros_like)
    narrow = staticmethod(narrow)
    pad = staticmethod(pad)
    all_gather = staticmethod(all_gather)
    all_reduce = staticmethod(all_reduce)
    reduce_scatter = staticmethod(reduce_scatter)
    all_to_all = staticmethod(all_to_all)
    broadcast = staticmethod(broadcast)
    barrier = staticmethod(barrier)
    all_gather_object = staticmethod(all_gather_object)

    @staticmethod
    def gather_int_rows(rows: list[list[int]], group: Any, n: int, index: int) -> list[list[int]]:
        return gather_int_table(np.array(rows, np.int64), group, n, index).tolist()  # type: ignore[no-any-return]

    @staticmethod
    def scatter(t: Any, dim: int, src_index: int, group: Any, n: int, index: int, src_global_rank: int) -> Tensor:
        """No scatter on MindSpore's CPU backend: the source's whole value is broadcast and each
        rank keeps its piece."""
        return _chunk(broadcast(t, src_index, group, n, index, src_global_rank), dim, n, index)


COLLECTIVES = _Collectives()
