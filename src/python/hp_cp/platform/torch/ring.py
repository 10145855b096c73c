"""Ring attention on torch: each block of queries against a block of keys/values runs the fused
flash-attention kernel (on CPU: it takes grouped key/value heads and an additive mask and returns
the block's log-sum-exp, no score matrix is kept), elsewhere explicit matmuls; blocks are merged
by log-sum-exp (online softmax), forward and backward.

Forward: at step ``i`` a rank holds the keys/values of ring participant ``index - i``; with
``async_comm`` it starts sending them on to ``index + 1`` (and receiving the next from
``index - 1``) before computing on them, so the transfer overlaps the block's compute.  Backward
runs the ring again: keys/values travel the same way, and their gradient buffer travels with
them, each rank adding its queries' contribution (with ``async_comm`` the buffer's hop overlaps
the next step's compute); one last hop returns every buffer to its owner.  Blocks wholly in the
causal future, or (EOD data) with no query and key in the same document, are never computed; a
block on the diagonal is the kernel's own causal case, a block in the causal past runs unmasked
and only blocks that cut a document carry a mask, one block large.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_cp.layout import BlockKind, RingPlan, Segment
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


@dataclass(frozen=True)
class _Block:
    """One query segment against one key segment: offsets into the rank's local tensors, and how
    the kernel masks it (``causal``: the kernel's own top-left causal mask on a square block on
    the diagonal; ``mask``: an additive mask, 0 or -inf, where documents or an off-grid diagonal
    cut the block; ``live``: the rows that see at least one key, when some see none)."""

    qo: int
    ql: int
    ko: int
    kl: int
    causal: bool
    mask: torch.Tensor | None
    live: torch.Tensor | None


def _blocks(plan: RingPlan, step: int, doc_ids: torch.Tensor | None, dtype: torch.dtype) -> list[_Block]:
    """The blocks step ``step`` computes, with their masks (the same list forward and backward):
    one kernel call for the whole step where the plan's blocks tile a rectangle (without
    documents), else one per block."""
    mine, theirs = plan.segments[plan.index], plan.segments[plan.source(step)]
    if doc_ids is None:
        whole = _one_call(plan, step)
        if whole is not None:
            return [whole]
    qoff = _offsets(mine)
    koff = _offsets(theirs)
    out = []
    for qo, ql, ko, kl, qi, ki, kind in plan.blocks(step):
        qs, ks = mine[qi], theirs[ki]
        causal = kind is BlockKind.CAUSAL and qs == ks
        allowed = None
        if kind is BlockKind.CAUSAL and not causal:
            qpos = torch.arange(qs.start, qs.end, device=doc_ids.device if doc_ids is not None else None)
            kpos = torch.arange(ks.start, ks.end, device=qpos.device)
            allowed = (kpos[None, :] <= qpos[:, None])[None, None]
        if doc_ids is not None:
            dq, dk = doc_ids[:, qs.start:qs.end], doc_ids[:, ks.start:ks.end]
            # document ids never decrease along the sequence: compare the segments' ends first
            if bool((dk[:, 0] > dq[:, -1]).all()) or bool((dk[:, -1] < dq[:, 0]).all()):
                continue  # no query shares a document with any key
            if not bool(((dq[:, 0] == dq[:, -1]) & (dk[:, 0] == dq[:, 0]) & (dk[:, -1] == dq[:, 0])).all()):
                same = (dq[:, :, None] == dk[:, None, :])[:, None]
                if causal:  # the kernel cannot combine its causal flag with a mask
                    pos = torch.arange(qs.length, device=doc_ids.device)
                    same = same & (pos[None, :] <= pos[:, None])[None, None]
                    causal = False
                allowed = same if allowed is None else (allowed & same)
        mask = live = None
        if allowed is not None:
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)
            rows = allowed.any(-1)
            live = None if bool(rows.all()) else rows
        out.append(_Block(qoff[qi], ql, koff[ki], kl, causal, mask, live))
        assert (qo, ko) == (qoff[qi], koff[ki])
    return out


def _one_call(plan: RingPlan, step: int) -> _Block | None:
    """The step's blocks as one kernel call, where they allow it.  Own keys (step 0) over segments
    in increasing position order: the kernel's causal flag on the concatenation is the causal
    mask by position (a later local index is a later position).  Any other step whose blocks
    are all unmasked and cover contiguous query rows times contiguous key rows: one unmasked
    call over that rectangle (with the load-balanced split every step is one of these)."""
    mine, theirs = plan.segments[plan.index], plan.segments[plan.source(step)]
    if step == 0:
        ascending = all(a.end <= b.start for a, b in zip(mine, mine[1:]))
        total = sum(seg.length for seg in mine)
        return _Block(0, total, 0, total, True, None, None) if ascending else None
    blocks = plan.blocks(step)
    if not blocks or any(kind is not BlockKind.FULL for *_, kind in blocks):
        return None
    qsegs = sorted({b[4] for b in blocks})
    ksegs = sorted({b[5] for b in blocks})
    if (len(blocks) != len(qsegs) * len(ksegs) or qsegs != list(range(qsegs[0], qsegs[-1] + 1))
            or ksegs != list(range(ksegs[0], ksegs[-1] + 1))):
        return None
    qoff, koff = _offsets(mine), _offsets(theirs)
    return _Block(qoff[qsegs[0]], sum(mine[i].length for i in qsegs), koff[ksegs[0]],
                  sum(theirs[i].length for i in ksegs), False, None, None)


def _offsets(segments: tuple[Segment, ...]) -> list[int]:
    offs, o = [], 0
    for s in segments:
        offs.append(o)
        o += s.length
    return offs


# Devices whose fused flash-attention kernel takes an additive mask, grouped key/value heads
# and returns the log-sum-exp; elsewhere a block runs as explicit matmuls over its score matrix.
_FUSED_DEVICES = frozenset({"cpu"})


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: _Block, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output and log-sum-exp (B, H, Lq); -inf for a row that sees no key."""
    if q.device.type in _FUSED_DEVICES:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, blk.causal, attn_mask=blk.mask, scale=scale)
        if blk.live is not None:  # the kernel reports 0 for a row that sees no key
            lse = lse.masked_fill(~blk.live.expand_as(lse), -math.inf)
        return out, lse
    rep = q.shape[1] // k.shape[1]
    s = _scores(q, _expand(k, rep), blk, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return p @ _expand(v, rep), lse


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, blk: _Block, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's query, key and value gradients, given the merged ``out`` and ``lse``."""
    if q.device.type in _FUSED_DEVICES:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, blk.causal, attn_mask=blk.mask, scale=scale)
        return dq, dk, dv
    rep = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, rep), _expand(v, rep)
    p = torch.exp(_scores(q, ke, blk, scale) - lse.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ ve.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) * scale
    return ds @ ke, _fold(ds.transpose(-1, -2) @ q, rep), _fold(dv, rep)


def _scores(q: torch.Tensor, k: torch.Tensor, blk: _Block, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if blk.causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return s if blk.mask is None else s + blk.mask


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.reshape(b, h // rep, rep, s, d).sum(2)


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor, exact_rows: bool
           ) -> None:
    """Fold a block's output and log-sum-exp into the running ``out``/``lse`` (in place).
    ``exact_rows``: every row has seen a key in both, so no -inf needs guarding."""
    if exact_rows:
        # out += sigmoid(blk_lse - lse) * (blk_out - out); lse = logaddexp(lse, blk_lse)
        w = torch.sigmoid(blk_lse - lse).unsqueeze(-1)
        out.add_((blk_out - out).mul_(w))
        lse.copy_(torch.logaddexp(lse, blk_lse))
        return
    new = torch.logaddexp(lse, blk_lse)
    base = _finite(new)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(blk_out * torch.exp(blk_lse - base).unsqueeze(-1))
    lse.copy_(new)


def _fold_in(out: torch.Tensor, lse: torch.Tensor, rows: slice, blk_out: torch.Tensor, blk_lse: torch.Tensor,
             seen: list[bool], no_documents: bool) -> None:
    """Put a block's result into ``out``/``lse`` at ``rows``: copied where none of its query
    segments has a result yet, merged where all have (rows not seen yet hold lse -inf, which the
    guarded merge takes as it comes)."""
    if not any(seen):
        out[:, :, rows] = blk_out
        lse[:, :, rows] = blk_lse
    else:
        _merge(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse, no_documents and all(seen))


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
    doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qf = q.to(acc)
    out: torch.Tensor | None = None  # allocated unless the first call covers every row
    lse: torch.Tensor | None = None
    seen = [False] * len(plan.segments[plan.index])  # whether a query segment has any block merged yet
    qoff = _offsets(plan.segments[plan.index])
    kv = torch.stack([k, v])
    n = plan.size
    for step in range(n):
        pending = None
        if step + 1 < n and async_comm:
            pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
        kf, vf = kv[0].to(acc), kv[1].to(acc)
        for blk in _blocks(plan, step, doc_ids, acc):
            qs, ks = slice(blk.qo, blk.qo + blk.ql), slice(blk.ko, blk.ko + blk.kl)
            b_out, b_lse = _flash(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], blk, scale)
            covered = [i for i, o in enumerate(qoff) if blk.qo <= o < blk.qo + blk.ql]
            if out is None and len(covered) == len(seen):  # the first call covers every row: its result
                out, lse = b_out, b_lse
            else:
                if out is None or lse is None:
                    out = torch.zeros(q.shape, dtype=acc, device=q.device)
                    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
                _fold_in(out, lse, qs, b_out, b_lse, [seen[i] for i in covered], doc_ids is None)
            for i in covered:
                seen[i] = True
        if step + 1 < n:
            if pending is None:
                pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
            kv = pending.wait()
    assert out is not None and lse is not None, "the ring's first step covers every query row"
    return out, lse


def _ring_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, plan: RingPlan, scale: float, doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = out.dtype
    qf, do = q.to(acc), dout.to(acc)
    dq: torch.Tensor | None = None  # allocated unless the first call covers every query row
    kv = torch.stack([k, v])
    dkv = kv  # replaced by the first step's gradients
    in_flight = None  # the gradient buffer's hop, overlapping the next step's compute
    n = plan.size
    for step in range(n):
        pending = None
        if step + 1 < n and async_comm:
            pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
        kf, vf = kv[0].to(acc), kv[1].to(acc)
        local = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for blk in _blocks(plan, step, doc_ids, acc):
            qs, ks = slice(blk.qo, blk.qo + blk.ql), slice(blk.ko, blk.ko + blk.kl)
            gq, gk, gv = _flash_backward(do[:, :, qs], qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], out[:, :, qs],
                                         lse[:, :, qs], blk, scale)
            if dq is None and blk.ql == q.shape[2]:  # the first call covers every query row
                dq = gq
            else:
                if dq is None:
                    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
                dq[:, :, qs] += gq
            local[0, :, :, ks] += gk
            local[1, :, :, ks] += gv
        if in_flight is not None:
            dkv = in_flight.wait()
            in_flight = None
        dkv = local.add_(dkv) if step > 0 else local
        if n > 1:
            # the gradient buffer goes on with the keys/values it belongs to; after the last
            # step this hop brings every buffer home
            in_flight = _Exchange(dkv, plan.next_rank, plan.prev_rank, _TAG_DKV, group)
            if not async_comm or step + 1 == n:
                dkv = in_flight.wait()
                in_flight = None
        if step + 1 < n:
            if pending is None:
                pending = _Exchange(kv, plan.next_rank, plan.prev_rank, _TAG_KV, group)
            kv = pending.wait()
    assert dq is not None, "the ring's first step covers every query row"
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
