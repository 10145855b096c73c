"""Ring attention on torch: online-softmax (log-sum-exp) merging of key/value blocks that travel
around the ring, forward and backward.

Forward: at step ``i`` a rank holds the keys/values of ring participant ``index - i``; it starts
sending them on to ``index + 1`` (and receiving the next from ``index - 1``) before computing
on them when ``async_comm`` is set, so the transfer overlaps the block's compute.  Backward runs
the ring again: keys/values travel the same way, and their gradient buffer travels with them,
each rank adding its queries' contribution; one last hop returns every buffer to its owner.
Blocks wholly in the causal future are never computed (the plan leaves them out).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from hp_cp.layout import BlockKind, RingPlan
from hp_dtensor.comm_debug import record

_TAG_KV = 7100
_TAG_DKV = 7101


class _Exchange:
    """Send ``out`` to ``dst`` and receive a tensor shaped like it from ``src`` (one counted
    ``send_recv``); ``wait()`` returns what arrived."""

    def __init__(self, out: torch.Tensor, dst: int, src: int, tag: int, group: Any) -> None:
        out = out.contiguous()
        self._out = out
        self._buf = torch.empty_like(out)
        record("send_recv", out.numel() * out.element_size(), 2)
        self._works = [dist.isend(out, dst, group=group, tag=tag), dist.irecv(self._buf, src, group=group, tag=tag)]

    def wait(self) -> torch.Tensor:
        for w in self._works:
            if w is not None:
                w.wait()
        return self._buf


def _positions(plan: RingPlan, holder: int, device: torch.device) -> torch.Tensor:
    idx = [p for s in plan.segments[holder] for p in range(s.start, s.end)]
    return torch.tensor(idx, dtype=torch.long, device=device)


def _block_mask(
    kind: BlockKind, qpos: torch.Tensor, kpos: torch.Tensor, doc_ids: torch.Tensor | None
) -> torch.Tensor | None:
    """True where masked; (B or 1, 1, Lq, Lk), or None when nothing in the block is masked."""
    mask = None
    if kind is BlockKind.CAUSAL:
        mask = (kpos[None, :] > qpos[:, None])[None, None]
    if doc_ids is not None:
        other_doc = (doc_ids[:, qpos][:, :, None] != doc_ids[:, kpos][:, None, :])[:, None]
        mask = other_doc if mask is None else (mask | other_doc)
    return mask


def _scores(qb: torch.Tensor, kb: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = (qb @ kb.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(2)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
    doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    acc_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qf = q.to(acc_dtype)
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    qpos = _positions(plan, plan.index, q.device)
    kv = torch.stack([k, v])
    n = plan.size
    for step in range(n):
        pending = None
        if step + 1 < n and async_comm:
            pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
        kpos = _positions(plan, plan.source(step), q.device)
        kf, vf = _expand(kv[0], rep).to(acc_dtype), _expand(kv[1], rep).to(acc_dtype)
        for qo, ql, ko, kl, _, _, kind in plan.blocks(step):
            mask = _block_mask(kind, qpos[qo:qo + ql], kpos[ko:ko + kl], doc_ids)
            s = _scores(qf[:, :, qo:qo + ql], kf[:, :, ko:ko + kl], scale, mask)
            blk_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _finite(blk_lse).unsqueeze(-1))
            blk_out = p @ vf[:, :, ko:ko + kl]
            old = lse[:, :, qo:qo + ql]
            new = torch.logaddexp(old, blk_lse)
            base = _finite(new)
            out[:, :, qo:qo + ql] = (out[:, :, qo:qo + ql] * torch.exp(old - base).unsqueeze(-1)
                                     + blk_out * torch.exp(blk_lse - base).unsqueeze(-1))
            lse[:, :, qo:qo + ql] = new
        if step + 1 < n:
            if pending is None:
                pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
            kv = pending.wait()
    return out, lse


def _ring_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, plan: RingPlan, scale: float, doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    acc = out.dtype
    qf, do = q.to(acc), dout.to(acc)
    delta = (do * out).sum(-1)  # rowsum(dO * O), the softmax backward's correction
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    qpos = _positions(plan, plan.index, q.device)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    n = plan.size
    for step in range(n):
        pending = None
        if step + 1 < n and async_comm:
            pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
        kpos = _positions(plan, plan.source(step), q.device)
        kf, vf = _expand(kv[0], rep).to(acc), _expand(kv[1], rep).to(acc)
        dk_full = torch.zeros(kf.shape, dtype=acc, device=q.device)
        dv_full = torch.zeros(vf.shape, dtype=acc, device=q.device)
        for qo, ql, ko, kl, _, _, kind in plan.blocks(step):
            mask = _block_mask(kind, qpos[qo:qo + ql], kpos[ko:ko + kl], doc_ids)
            qb, kb, vb, dob = qf[:, :, qo:qo + ql], kf[:, :, ko:ko + kl], vf[:, :, ko:ko + kl], do[:, :, qo:qo + ql]
            s = _scores(qb, kb, scale, mask)
            p = torch.exp(s - _finite(lse[:, :, qo:qo + ql]).unsqueeze(-1))
            dv_full[:, :, ko:ko + kl] += p.transpose(-1, -2) @ dob
            dp = dob @ vb.transpose(-1, -2)
            ds = p * (dp - delta[:, :, qo:qo + ql].unsqueeze(-1)) * scale
            dq[:, :, qo:qo + ql] += ds @ kb
            dk_full[:, :, ko:ko + kl] += ds.transpose(-1, -2) @ qb
        dkv = dkv + torch.stack([_fold(dk_full, rep), _fold(dv_full, rep)])
        if n > 1:
            # the gradient buffer goes on with the keys/values it belongs to; after the last
            # step this hop brings every buffer home
            dkv = _Exchange(dkv, plan.next_rank, plan.prev_rank, _TAG_DKV, group).wait()
        if step + 1 < n:
            if pending is None:
                pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
            kv = pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
        doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, plan, scale, doc_ids, async_comm, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.doc_ids, ctx.async_comm, ctx.group = plan, scale, doc_ids, async_comm, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan, ctx.scale, ctx.doc_ids,
                                    ctx.async_comm, ctx.group)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
    doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
) -> torch.Tensor:
    """Differentiable ring attention; the exchanges run on ``group`` (the ring's own process
    group: global ranks ``plan.peers`` address it)."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    if not math.isfinite(scale):
        raise ValueError(f"attention scale must be finite, got {scale}")
    return _RingAttention.apply(q, k, v, plan, scale, doc_ids, async_comm, group)  # type: ignore[no-any-return]
