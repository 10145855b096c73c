"""Collectives on local tensors along one mesh dim (no autograd; callers provide duals).

Every function records itself in ``CommDebugMode``.  ``avg`` is not a gloo reduce op, so it is a
sum followed by a division.  ``max``/``min`` of floating-point values run on order-preserving
integer keys of the same width (no extra bytes move, except 16-bit floats, which gloo can only
order through 32-bit keys): gloo's float MAX/MIN drop NaN, the keys
put NaN above +inf (max) or below -inf (min), so a NaN on any rank gives NaN on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.comm_debug import record

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


_KEY_DTYPE = {8: torch.int64, 4: torch.int32}
_KEY_MASK = {8: 0x7FFFFFFFFFFFFFFF, 4: 0x7FFFFFFF}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _needs_keys(t: torch.Tensor, op: str) -> bool:
    return op in ("max", "min") and t.is_floating_point() and t.element_size() in (2, 4, 8)


def _to_keys(t: torch.Tensor, op: str) -> torch.Tensor:
    """Integer keys ordered like the floats, with every NaN made the extreme of ``op``.

    Non-negative floats keep their bits; negative ones flip all but the sign bit, so the signed
    integer order is the float order.  NaN becomes the largest key (max) or the smallest (min):
    both decode to a NaN."""
    if t.element_size() == 2:  # gloo has no int16 reductions: 16-bit floats go through float32 (exact)
        t = t.float()
    t = t.contiguous()
    kdt = _KEY_DTYPE[t.element_size()]
    bits = t.view(kdt)
    keys = torch.where(bits >= 0, bits, bits ^ _KEY_MASK[t.element_size()])
    info = torch.iinfo(kdt)
    return keys.masked_fill(torch.isnan(t), info.max if op == "max" else info.min)


def _from_keys(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = keys.element_size()
    bits = torch.where(keys >= 0, keys, keys ^ _KEY_MASK[size])
    return bits.view(torch.float32).to(dtype) if size == 4 and dtype != torch.float32 else bits.view(dtype)


def all_reduce(t: torch.Tensor, op: str, group: Any, n: int) -> torch.Tensor:
    keys = _needs_keys(t, op)
    out = _to_keys(t, op) if keys else t.contiguous().clone()
    record("all_reduce", _nbytes(out), n)
    dist.all_reduce(out, op=_OPS[op], group=group)
    if keys:
        return _from_keys(out, t.dtype)
    if op == "avg":
        out.div_(n)
    return out


def all_gather(t: torch.Tensor, dim: int, group: Any, n: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` in group order."""
    t = t.contiguous()
    buf = t.new_empty((n * t.shape[0],) + tuple(t.shape[1:])) if t.ndim else t.new_empty((n,))
    record("all_gather", _nbytes(t) * n, n)
    dist.all_gather_single(buf, t if t.ndim else t.reshape(1), group=group)
    if dim == 0 or t.ndim == 0:
        return buf
    # contiguous: a reshape that happens to be a view would hand ops a strided local tensor
    return buf.view((n,) + tuple(t.shape)).movedim(0, dim).reshape(
        tuple(t.shape[:dim]) + (n * t.shape[dim],) + tuple(t.shape[dim + 1 :])
    ).contiguous()


def reduce_scatter(t: torch.Tensor, dim: int, op: str, group: Any, n: int) -> torch.Tensor:
    """Reduce ``t`` over the group and keep chunk ``coordinate`` of ``dim``."""
    keys = _needs_keys(t, op)
    moved = t.movedim(dim, 0).contiguous()
    if keys:
        moved = _to_keys(moved, op)
    out = moved.new_empty((moved.shape[0] // n,) + tuple(moved.shape[1:]))
    record("reduce_scatter", _nbytes(moved), n)
    dist.reduce_scatter_single(out, moved, op=_OPS[op], group=group)
    if keys:
        out = _from_keys(out, t.dtype)
    elif op == "avg":
        out.div_(n)
    return out.movedim(0, dim).contiguous()


def all_to_all(t: torch.Tensor, split_dim: int, concat_dim: int, group: Any, n: int) -> torch.Tensor:
    """Shard(concat_dim) -> Shard(split_dim): send chunk r of ``split_dim`` to rank r, concatenate
    what arrives along ``concat_dim``."""
    send = torch.stack(t.chunk(n, dim=split_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    record("all_to_all", _nbytes(send), n)
    dist.all_to_all_single(recv, send, group=group)
    shape = list(recv.shape[1:])
    moved = recv.movedim(0, concat_dim)
    shape[concat_dim] *= n
    return moved.reshape(shape).contiguous()


def broadcast(t: torch.Tensor, src_global_rank: int, group: Any) -> torch.Tensor:
    out = t.contiguous().clone()
    record("broadcast", _nbytes(out))
    dist.broadcast(out, src=src_global_rank, group=group)
    return out


def scatter(
    chunks: list[torch.Tensor] | None, out_like: torch.Tensor, src_global_rank: int, group: Any
) -> torch.Tensor:
    out = torch.empty_like(out_like).contiguous()
    record("scatter", _nbytes(out))
    dist.scatter(out, [c.contiguous() for c in chunks] if chunks is not None else None, src=src_global_rank, group=group)
    return out


def barrier(group: Any, n: int) -> None:
    if n == 1:
        return
    record("barrier", 0, n)
    dist.barrier(group=group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """``obj`` of every rank of ``group`` (default: the world), in rank order (``[obj]`` without
    a process group).  Counted as one ``all_gather_object`` (its bytes are pickles, unknown here)."""
    if not dist.is_initialized():
        return [obj]
    n = dist.get_world_size(group)
    out: list[Any] = [None] * n
    record("all_gather_object", 0, n)
    dist.all_gather_object(out, obj, group=group)
    return out


class _Collectives:
    """torch's ``Collectives`` (the backend contract's one signature per collective): gloo, nccl
    and hccl need no coordinate, so ``index`` is unused here."""

    @staticmethod
    def chunk(t: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
        size = t.shape[dim] // n
        return t.narrow(dim, index * size, size).contiguous()

    @staticmethod
    def narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        return t.narrow(dim, start, length).contiguous()

    @staticmethod
    def pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = size - shape[dim]
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    zeros_like = staticmethod(torch.zeros_like)

    @staticmethod
    def all_gather(t: torch.Tensor, dim: int, group: Any, n: int, index: int) -> torch.Tensor:
        return all_gather(t, dim, group, n)

    @staticmethod
    def all_reduce(t: torch.Tensor, op: str, group: Any, n: int, index: int) -> torch.Tensor:
        return all_reduce(t, op, group, n)

    @staticmethod
    def reduce_scatter(t: torch.Tensor, dim: int, op: str, group: Any, n: int, index: int) -> torch.Tensor:
        return reduce_scatter(t, dim, op, group, n)

    @staticmethod
    def all_to_all(t: torch.Tensor, split_dim: int, concat_dim: int, group: Any, n: int, index: int) -> torch.Tensor:
        return all_to_all(t, split_dim, concat_dim, group, n)

    @staticmethod
    def broadcast(t: torch.Tensor, src_index: int, group: Any, n: int, index: int, src_global_rank: int) -> torch.Tensor:
        return broadcast(t, src_global_rank, group)

    @staticmethod
    def scatter(
        t: torch.Tensor, dim: int, src_index: int, group: Any, n: int, index: int, src_global_rank: int
    ) -> torch.Tensor:
        pieces = list(t.chunk(n, dim)) if index == src_index else None
        return scatter(pieces, t.narrow(dim, 0, t.shape[dim] // n), src_global_rank, group)

    barrier = staticmethod(barrier)

    @staticmethod
    def all_gather_object(obj: Any, group: Any, n: int, index: int) -> list[Any]:
        return all_gather_object(obj, group)

    @staticmethod
    def gather_int_rows(rows: list[list[int]], group: Any, n: int, index: int) -> list[list[int]]:
        # nccl and hccl move device tensors only; gloo moves CPU tensors.
        device = {"nccl": "cuda", "hccl": "npu"}.get(str(dist.get_backend(group)), "cpu")
        table = torch.tensor(rows, dtype=torch.int64, device=device)
        return all_gather(table, 0, group, n).tolist()  # type: ignore[no-any-return]


COLLECTIVES = _Collectives()
