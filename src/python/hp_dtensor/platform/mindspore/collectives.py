"""Collectives on local MindSpore tensors along one mesh dim (no autograd; callers give duals).

MindSpore's CPU backend (mccl) runs only AllReduce (sum, float32/float16) on any group, and
AllGather / Broadcast on the world group.  Everything else is composed here from those:

* ``all_gather`` on a subgroup: each rank writes its block into a zero buffer at its slot and the
  buffers are summed with AllReduce (adding zeros is exact, so the result is bit-identical);
* ``reduce_scatter``: AllReduce, then the rank keeps its chunk (a ring all-reduce moves about twice
  the bytes of a native reduce-scatter);
* ``all_to_all``: all_gather along the source shard dim, then the rank keeps its chunk of the
  target dim (n times the bytes of a native all-to-all);
* ``broadcast`` on a subgroup: zeros on every rank but the source, then AllReduce;
* ``max``/``min`` reductions: all_gather, then the local max/min;
* ``barrier``: an AllReduce of one element.

On Ascend the native HCCL collectives are used.  ``CommDebugMode`` counts the logical collective
(a composed reduce_scatter counts as one reduce_scatter), with the bytes the composition moves.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore import Tensor, mint, ops

from hp_dtensor.comm_debug import record
from hp_dtensor.platform.mindspore import process_group as PG

_NATIVE_FLOATS = (ms.float32, ms.float16)


def _plain(t: Any) -> Tensor:
    """A plain Tensor sharing ``t``'s data (a DTensor is a Tensor subclass)."""
    return t if type(t) is Tensor else Tensor._make_subclass(Tensor, t)


def _nbytes(t: Tensor) -> int:
    return int(t.size) * int(t.itemsize)


def _native() -> bool:
    return PG.device_target() != "CPU"


def _is_world(group: Any) -> bool:
    return bool(group == PG.world_group())


def _raw_all_reduce_sum(t: Tensor, group: Any) -> Tensor:
    if t.dtype in _NATIVE_FLOATS or _native():
        return ops.AllReduce(group=group)(t)
    if not t.is_floating_point():
        raise TypeError(
            f"all_reduce of {t.dtype} tensors is not supported by MindSpore's CPU backend (float32/float16 only)"
        )
    return ops.AllReduce(group=group)(t.astype(ms.float32)).astype(t.dtype)


def _raw_all_gather0(t: Tensor, group: Any, n: int, index: int) -> Tensor:
    """Concatenate every rank's ``t`` along dim 0, in group order."""
    if _native() or _is_world(group):
        return ops.AllGather(group=group)(t)
    buf = mint.zeros((n,) + tuple(t.shape), dtype=t.dtype)
    buf[index] = t
    summed = _raw_all_reduce_sum(buf, group)
    return summed.reshape((n * t.shape[0],) + tuple(t.shape[1:]))


def _gathered_max_min(t: Tensor, op: str, group: Any, n: int, index: int) -> Tensor:
    """max/min over the group, which CPU AllReduce lacks: gather every rank's copy, reduce locally."""
    if op not in ("max", "min"):
        raise ValueError(f"reduce op {op!r} is not one of sum, avg, max, min")
    stacked = _raw_all_gather0(t.reshape((1,) + tuple(t.shape)), group, n, index)
    return stacked.max(axis=0) if op == "max" else stacked.min(axis=0)


def all_reduce(t: Any, op: str, group: Any, n: int, index: int) -> Tensor:
    t = _plain(t)
    if n == 1:
        return t
    record("all_reduce", _nbytes(t))
    if op in ("sum", "avg"):
        out = _raw_all_reduce_sum(t, group)
        return out / n if op == "avg" else out
    if _native():
        return ops.AllReduce(op=op, group=group)(t)
    return _gathered_max_min(t, op, group, n, index)


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
    moved = mint.transpose(t, 0, dim).contiguous()
    return mint.transpose(_raw_all_gather0(moved, group, n, index), 0, dim).contiguous()


def _chunk(t: Tensor, dim: int, n: int, index: int) -> Tensor:
    size = t.shape[dim] // n
    return mint.narrow(t, dim, index * size, size).contiguous()


def reduce_scatter(t: Any, dim: int, op: str, group: Any, n: int, index: int) -> Tensor:
    """Reduce ``t`` over the group and keep this rank's chunk of ``dim``."""
    t = _plain(t)
    if n == 1:
        return t
    record("reduce_scatter", _nbytes(t))
    if _native() and op in ("sum", "max", "min"):
        moved = mint.transpose(t, 0, dim).contiguous() if dim else t
        out = ops.ReduceScatter(op=op, group=group)(moved)
        return mint.transpose(out, 0, dim).contiguous() if dim else out
    if op in ("sum", "avg"):
        full = _raw_all_reduce_sum(t, group)
        if op == "avg":
            full = full / n
    else:
        full = _gathered_max_min(t, op, group, n, index)
    return _chunk(full, dim, n, index)


def all_to_all(t: Any, split_dim: int, concat_dim: int, group: Any, n: int, index: int) -> Tensor:
    """Shard(concat_dim) -> Shard(split_dim): this rank ends with chunk ``index`` of ``split_dim``,
    concatenated over the ranks along ``concat_dim``."""
    t = _plain(t)
    if n == 1:
        return t
    record("all_to_all", _nbytes(t))
    if _native():
        return ops.AlltoAll(split_count=n, split_dim=split_dim, concat_dim=concat_dim, group=group)(t.contiguous())
    moved = mint.transpose(t, 0, concat_dim).contiguous() if concat_dim else t
    gathered = _raw_all_gather0(moved, group, n, index)
    if concat_dim:
        gathered = mint.transpose(gathered, 0, concat_dim).contiguous()
    return _chunk(gathered, split_dim, n, index)


def broadcast(t: Any, src_index: int, group: Any, n: int, index: int, src_global_rank: int) -> Tensor:
    """Every rank gets the value of group-rank ``src_index``."""
    t = _plain(t)
    if n == 1:
        return t
    record("broadcast", _nbytes(t))
    if _native() or _is_world(group):
        if t.dtype == ms.bfloat16:
            return ops.Broadcast(src_global_rank, group=group)((t.astype(ms.float32),))[0].astype(t.dtype)
        return ops.Broadcast(src_global_rank, group=group)((t.contiguous(),))[0]
    mine = t if index == src_index else ops.zeros_like(t)
    return _raw_all_reduce_sum(mine, group)


def barrier(group: Any, n: int) -> None:
    if n == 1:
        return
    record("barrier", 4)
    out = _raw_all_reduce_sum(mint.ones((1,), dtype=ms.float32), group)
    out.asnumpy()  # wait for it
