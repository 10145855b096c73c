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

``parallelize_qwen3_5_cp`` applies context parallelism to a whole built model (after the TP plan
when there is one): full-attention layers run through ``ContextParallel.attention`` (ring,
ulysses or hybrid), Gated DeltaNet layers through ``gated_delta_net_cp``, rotary positions come
from the load-balanced split (restarting per document with packed data).  Each decoder layer takes
the batch's sequence facts (``SequenceFacts``: length, document ends) as an argument, so
activation checkpointing (applied after this, around the decoder layers) recomputes a layer with
its own forward's facts, and a pipeline stage, which holds some of the layers and receives hidden
states rather than tokens, can hand its layers the facts of its microbatch
(``parallelize_layers_cp``; ``hp_models.qwen3_5.pipeline_cp``).  The model's one-process code
path is left as it is.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hp_cp import ContextParallel, document_ids
from hp_models.qwen3_5.gated_delta import chunk_gated_delta_rule_with_state, compute_dtype, upcast
from hp_models.qwen3_5.model import (
    Attention,
    DecoderLayer,
    GatedDeltaNet,
    Qwen3_5ForCausalLM,
    TextModel,
    local,
)


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
    key_dim = local(layer.conv_q).shape[0]  # this rank's key channels (all of them without TP)
    dk, dv = layer.k_head_dim, layer.v_head_dim
    q = mixed[..., :key_dim].reshape(b, s_local, -1, dk)
    k = mixed[..., key_dim:2 * key_dim].reshape(b, s_local, -1, dk)
    v = mixed[..., 2 * key_dim:].reshape(b, s_local, -1, dv)
    z = layer.in_proj_z(x).reshape(b, s_local, -1, dv)
    beta = layer.in_proj_b(x).sigmoid()
    g = -upcast(local(layer.A_log)).exp() * F.softplus(upcast(layer.in_proj_a(x)) + local(layer.dt_bias))
    hv = v.shape[2]
    acc = compute_dtype(v.dtype)  # the recurrence's dtype

    def run(row: int, lo: int, hi: int, vals: torch.Tensor, init: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        sl = slice(lo, hi)
        return chunk_gated_delta_rule_with_state(
            q[row:row + 1, sl], k[row:row + 1, sl], vals, g[row:row + 1, sl], beta[row:row + 1, sl],
            layer.chunk_size, init,
        )

    # each chunk's state map S_end = P S_start + Q (P = 0 where a document starts inside)
    eye = torch.eye(dk, dtype=acc, device=x.device).expand(1, hv, dk, dk)
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
    starts = [torch.zeros(b, hv, dk, dv, dtype=acc, device=x.device)]
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


@dataclass
class SequenceFacts:
    """What the token mixers of a forward need beyond their input: the whole sequence's length
    and, for packed documents, each row's cumulative document ends (the compressed EOD mask)."""

    seq_len: int = 0
    actual_seq_len: Sequence[Sequence[int]] | None = None


def parallelize_qwen3_5_cp(model: Qwen3_5ForCausalLM, cp: ContextParallel) -> Qwen3_5ForCausalLM:
    """Apply context parallelism to ``model`` in place (after ``parallelize_qwen3_5_tp`` when the
    model is also tensor parallel, whose ``sequence_parallel`` must then be off); returns it.

    The model's forward then takes this rank's share of the batch, ``cp.split(input_ids, dim=1)``
    (B, S / cp), and optionally ``actual_seq_len=`` (cumulative document ends per row of the
    whole sequence, the compressed EOD mask; required when the CP config says EOD) and returns
    this rank's share of the logits.  Split the labels the same way and reduce the loss with
    ``cp_cross_entropy``.  Parameters stay replicated over the CP ranks and each rank's
    gradient is its tokens' share: FSDP over ``dp_shard * cp`` sums them, or
    ``sum_cp_gradients`` without FSDP."""
    text: TextModel = model.model
    pending = SequenceFacts()  # the facts of the forward in progress, from the top to the layers

    def causal_lm_forward(self: Qwen3_5ForCausalLM, input_ids: torch.Tensor, *,
                          actual_seq_len: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        pending.seq_len = input_ids.shape[1] * cp.cp
        pending.actual_seq_len = actual_seq_len
        try:
            return self.lm_head(self.model(input_ids))  # type: ignore[no-any-return]
        finally:
            pending.actual_seq_len = None

    def text_forward(self: TextModel, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        facts = SequenceFacts(pending.seq_len, pending.actual_seq_len)
        cos, sin = cp_rotary(self.rotary_emb, cp, facts, input_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, tokens=facts)
        return self.norm(x)  # type: ignore[no-any-return]

    # The forwards are bound per instance: hooks (the TP plan's) still run around them, and the
    # class's forward, the one-process path, is untouched.
    _bind(model, causal_lm_forward)
    _bind(text, text_forward)
    layers: Any = text.layers
    parallelize_layers_cp(list(layers), cp)
    return model


def cp_rotary(rotary: Any, cp: ContextParallel, facts: SequenceFacts, like: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at this rank's positions of the sequence ``facts`` describes (restarting at
    every document of packed rows); ``like``: a tensor of this rank's share, (B, S / cp, ...)."""
    if facts.actual_seq_len is not None:
        pos = cp.eod_position_ids(facts.actual_seq_len, facts.seq_len, like)
    else:
        pos = torch.tensor([cp.positions(facts.seq_len)], dtype=torch.long, device=like.device)
    return rotary.at(pos, dtype)  # type: ignore[no-any-return]


def parallelize_layers_cp(layers: Sequence[DecoderLayer], cp: ContextParallel) -> None:
    """Context parallelism inside the decoder ``layers`` (in place): each then takes the batch's
    ``SequenceFacts`` as its keyword argument ``tokens``; full attention runs through
    ``ContextParallel.attention``, Gated DeltaNet through ``gated_delta_net_cp``.  Used by the
    whole model and by a pipeline stage, which holds some of the layers."""
    batch = SequenceFacts()  # the facts of the layer running, read by its token mixer

    def layer_forward(self: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                      tokens: SequenceFacts) -> torch.Tensor:
        # The batch's facts travel with the layer's inputs, so a recomputation of the layer in
        # backward (activation checkpointing) sees the facts of its own forward, not the batch
        # state of whatever forward ran last (cleared when it ended).
        outer = (batch.seq_len, batch.actual_seq_len)
        batch.seq_len, batch.actual_seq_len = tokens.seq_len, tokens.actual_seq_len
        try:
            return type(self).forward(self, x, cos, sin)  # type: ignore[no-any-return]
        finally:
            batch.seq_len, batch.actual_seq_len = outer

    def attention_forward(self: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = self.project(x, cos, sin)
        o = cp.attention(q, k, v, seq_len=batch.seq_len, actual_seq_len=batch.actual_seq_len)
        return self.finish(o, gate)

    def delta_forward(self: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
        return gated_delta_net_cp(self, x, cp, batch.seq_len, batch.actual_seq_len)

    for layer in layers:
        _bind(layer, layer_forward)
        if layer.layer_type == "linear_attention":
            _bind(layer.linear_attn, delta_forward)
        else:
            _bind(layer.self_attn, attention_forward)


def _bind(module: Any, forward: Any) -> None:
    object.__setattr__(module, "forward", types.MethodType(forward, module))


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cp: ContextParallel,
                     ignore_index: int = -100) -> torch.Tensor:
    """The mean next-token loss over the whole sequence from this rank's share of the logits
    (B, S / cp, V) and labels (B, S / cp), shifted before the split: each rank sums its tokens'
    losses and counts its non-ignored labels, both summed over the CP group."""
    loss_sum = F.cross_entropy(upcast(local(logits).flatten(0, 1)), labels.flatten(), ignore_index=ignore_index,
                               reduction="sum")
    count = (labels != ignore_index).sum().to(loss_sum.dtype)
    return cp.reduce_loss(loss_sum, count)  # type: ignore[no-any-return]


def sum_cp_gradients(params: Iterable[torch.nn.Parameter], cp: ContextParallel) -> None:
    """Sum the gradients of parameters replicated over the CP ranks (each rank's holds its
    tokens' share) in place, in one all-reduce per CP mesh dim; for a model without FSDP over
    ``dp_shard * cp``.  DTensor gradients (TP) are summed shard by shard."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    with torch.no_grad():
        flat = cp.sum_over(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
