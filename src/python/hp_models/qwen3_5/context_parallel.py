"""Gated DeltaNet under context parallelism: each rank holds two chunks of the sequence (the
load-balanced split), yet the layer must equal the one-process layer.

Two things cross chunk boundaries.  The causal short convolution reads the previous
``kernel - 1`` tokens: the tail of every chunk is gathered once (a halo exchange).  The
recurrent state flows in sequence order: over a chunk the state map is affine,
``S_end = P S_start + Q``, so each rank computes ``(P, Q)`` of its chunks in parallel, one
all-gather gives every chunk's pair, each rank scans them in sequence order (small matmuls) to
the state its chunks start from, then finishes its chunks.  Packed documents (EOD data) reset
both: the convolution never reads across a document start and the state restarts at zero there.
Backward is autograd through the same steps (the all-gather's dual sums the gradients back).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hp_cp import ContextParallel, document_ids
from hp_models.qwen3_5.gated_delta import chunk_gated_delta_rule_with_state
from hp_models.qwen3_5.model import GatedDeltaNet, local


def _conv_chunk(xin: torch.Tensor, doc: torch.Tensor, weight: torch.Tensor, halo: int) -> torch.Tensor:
    """Causal depthwise conv + SiLU of ``xin`` (B, halo + L, C) onto its last L rows, each tap
    dropped where it reads another document than the output row's (``doc``: (B, halo + L))."""
    length = xin.shape[1] - halo
    y = torch.zeros_like(xin[:, halo:])
    for i in range(halo + 1):
        same = (doc[:, i:i + length] == doc[:, halo:]).unsqueeze(-1).to(xin.dtype)
        y = y + xin[:, i:i + length] * same * weight[:, i]
    return F.silu(y)


def _pieces(doc: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """Local (from, to) ranges of [start, end) that each lie in one document."""
    cuts = [p - start for p in range(start + 1, end) if doc[p] != doc[p - 1]]
    bounds = [0, *cuts, end - start]
    return list(zip(bounds[:-1], bounds[1:]))


def gated_delta_net_cp(
    layer: GatedDeltaNet, x: torch.Tensor, cp: ContextParallel, seq_len: int,
    actual_seq_len: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """``layer`` on this rank's share ``x`` (B, S_local, hidden) of a sequence of ``seq_len``
    tokens split with ``cp.split``; ``actual_seq_len`` (cumulative document ends per row) for
    packed documents.  Returns this rank's share of the layer's output."""
    b, s_local = x.shape[0], x.shape[1]
    weight = torch.cat([local(layer.conv_q), local(layer.conv_k), local(layer.conv_v)], dim=0)
    halo = weight.shape[-1] - 1
    segments = cp.segments(seq_len)
    if any(seg.length < halo for seg in segments):
        raise ValueError(
            f"each of the 2*cp chunks holds {segments[0].length} tokens but the convolution reads {halo} previous "
            f"tokens; use a sequence of at least {2 * cp.cp * halo} tokens"
        )
    docs = [document_ids(a, seq_len) for a in actual_seq_len] if actual_seq_len else [[0] * seq_len] * b
    doc = torch.tensor(docs, dtype=torch.long, device=x.device)
    offsets = [sum(s.length for s in segments[:i]) for i in range(len(segments))]
    chunks = cp.chunk_ids()

    # the convolution, with the previous chunk's tail as its halo
    proj = torch.cat([layer.in_proj_q(x), layer.in_proj_k(x), layer.in_proj_v(x)], dim=-1)
    tails = torch.stack([proj[:, o + s.length - halo:o + s.length] for o, s in zip(offsets, segments)])
    all_tails = cp.gather_chunks(tails)
    conv = []
    for o, s, c in zip(offsets, segments, chunks):
        prev = all_tails[c - 1] if c > 0 else torch.zeros_like(all_tails[0])
        pos = torch.arange(s.start - halo, s.end, device=x.device).clamp(min=0)
        conv.append(_conv_chunk(torch.cat([prev, proj[:, o:o + s.length]], dim=1), doc[:, pos], weight, halo))
    mixed = torch.cat(conv, dim=1)
    key_dim = layer.in_proj_q.out_features
    dk, dv = layer.k_head_dim, layer.v_head_dim
    q = mixed[..., :key_dim].reshape(b, s_local, -1, dk)
    k = mixed[..., key_dim:2 * key_dim].reshape(b, s_local, -1, dk)
    v = mixed[..., 2 * key_dim:].reshape(b, s_local, -1, dv)
    z = layer.in_proj_z(x).reshape(b, s_local, -1, dv)
    beta = layer.in_proj_b(x).sigmoid()
    g = -local(layer.A_log).float().exp() * F.softplus(layer.in_proj_a(x).float() + local(layer.dt_bias))
    hv = v.shape[2]

    def run(row: int, lo: int, hi: int, vals: torch.Tensor, init: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        sl = slice(lo, hi)
        return chunk_gated_delta_rule_with_state(
            q[row:row + 1, sl], k[row:row + 1, sl], vals, g[row:row + 1, sl], beta[row:row + 1, sl],
            layer.chunk_size, init,
        )

    # each chunk's state map S_end = P S_start + Q (P = 0 where a document starts inside)
    eye = torch.eye(dk, device=x.device).expand(1, hv, dk, dk)
    maps, plans = [], []
    for o, s in zip(offsets, segments):
        rows = []
        row_plans = []
        for r in range(b):
            pieces = [(o + lo, o + hi) for lo, hi in _pieces(docs[r], s.start, s.end)]
            carries = s.start > 0 and docs[r][s.start] == docs[r][s.start - 1]
            lo, hi = pieces[-1]
            _, q_state = run(r, lo, hi, v[r:r + 1, lo:hi], None)
            if carries and len(pieces) == 1:
                zeros = v.new_zeros(1, hi - lo, hv, dk)
                _, p_state = run(r, lo, hi, zeros, eye)
            else:
                p_state = torch.zeros_like(eye)
            rows.append(torch.cat([p_state, q_state], dim=-1))
            row_plans.append((pieces, carries))
        maps.append(torch.cat(rows))
        plans.append(row_plans)
    every = cp.gather_chunks(torch.stack(maps))  # (2*cp, B, Hv, Dk, Dk + Dv), sequence order

    # the scan over chunks in sequence order, to the state each of this rank's chunks starts from
    starts = [torch.zeros(b, hv, dk, dv, device=x.device)]
    for c in range(max(chunks)):
        p_c, q_c = every[c][..., :dk], every[c][..., dk:]
        starts.append(p_c @ starts[-1] + q_c)

    outs = []
    for c, row_plans in zip(chunks, plans):
        rows = []
        for r, (pieces, carries) in enumerate(row_plans):
            parts = []
            for i, (lo, hi) in enumerate(pieces):
                init = starts[c][r:r + 1] if (i == 0 and carries) else None
                parts.append(run(r, lo, hi, v[r:r + 1, lo:hi], init)[0])
            rows.append(torch.cat(parts, dim=1))
        outs.append(torch.cat(rows))
    normed = layer.norm(torch.cat(outs, dim=1), z).reshape(b, s_local, -1)
    return layer.out_proj(normed)
