"""The sparse-MoE Qwen3.5 text model (HF ``qwen3_5_moe_text`` semantics).

The token mixers, norms and rotary tables are the dense model's; each decoder layer's MLP is a
``SparseMoeBlock``.  The routed experts are held stacked, one ``(num_experts, out, in)`` tensor per
projection, so expert parallelism shards them on dim 0 and the state-dict adapter splits them
into HF's per-expert tensors.  ``GroupedExperts`` receives the tokens with their routed copies
grouped by expert (token index and routing weight per copy) and returns each token's weighted
sum: the seam where an expert-parallel style moves tokens to the ranks owning their experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, Partial
from hp_models.qwen3_5.gated_delta import compute_dtype
from hp_models.qwen3_5.model import MLP, DecoderLayer, TextModel, local
from hp_models.qwen3_5_moe.config import Qwen3_5MoeConfig
from hp_protocols import BaseModel, Module


class GroupedExperts(Module):
    """``num_experts`` SwiGLU experts held as stacked ``gate_proj``/``up_proj`` ``(E, I, H)`` and
    ``down_proj`` ``(E, H, I)``.

    ``forward(x, counts)`` takes rows grouped by expert (the first ``counts[0]`` rows for the first
    expert this module holds, and so on) and returns each row run through its expert.

    ``forward(x, counts, token_index, weights)`` takes the tokens ``x`` (T, H) and one entry per
    routed token copy, the copies grouped by expert: copy ``c`` runs token ``token_index[c]``
    through its expert, is scaled by its routing weight ``weights[c]``, and the copies of each
    token are summed into its row of the (T, H) result.  This is the form the MoE block calls:
    it tells an expert-parallel style which copies share a token, so a dispatcher may move each
    token once per destination and sum its copies' weighted outputs near the experts.  With
    ``token_index`` and ``weights`` omitted it is the same contract with one copy per row and
    weight 1.  Under expert parallelism the module holds a contiguous range of experts and
    ``counts`` has one entry per held expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, token_index: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (token_index is None) != (weights is None):
            raise ValueError("GroupedExperts takes token_index and weights together (one entry per token copy)")
        rows = x if token_index is None else x[token_index]
        out = self._run_grouped(rows, counts)
        if token_index is None or weights is None:
            return out
        # summed in copy order, as one process sums a token's top-k experts
        return torch.zeros_like(x).index_add(0, token_index, (out * weights.unsqueeze(-1)).to(x.dtype))

    def _run_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        wg, wu, wd = local(self.gate_proj), local(self.up_proj), local(self.down_proj)
        sizes = [int(n) for n in counts.tolist()]
        if len(sizes) != wg.shape[0]:
            raise ValueError(f"GroupedExperts got token counts for {len(sizes)} experts, it holds {wg.shape[0]}")
        outs = [
            F.linear(F.silu(F.linear(xe, wg[e])) * F.linear(xe, wu[e]), wd[e])
            for e, xe in enumerate(torch.split(x, sizes))
        ]
        if not outs:
            return x.new_zeros(0, wd.shape[1])
        return torch.cat(outs)


class SparseMoeBlock(Module):
    """Router (linear -> softmax -> top-k -> renormalise), routed experts, and a shared expert
    scaled by ``sigmoid(shared_expert_gate(x))``.  After each forward ``router_probs`` (T, E) and
    ``router_topk`` (T, k) hold this call's routing (for the load-balancing loss) and
    ``tokens_per_expert`` (E,) its assignment counts.

    Under a plan that splits the tokens over ranks (sequence parallel), the block runs on this
    rank's tokens only and ``token_mesh`` names the mesh they are split over: the router and the
    shared-expert gate then use their replicated weights locally (partial gradients, summed over
    the mesh) and the load-balancing loss sums its statistics over it (over every dim of it: the
    CP and TP ranks when both split the tokens)."""

    def __init__(self, config: Qwen3_5MoeConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.router_probs: torch.Tensor | None = None
        self.router_topk: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.token_mesh: DeviceMesh | None = None

    def route(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(softmax probabilities (T, E) in fp32 -- float64 for a float64 model --, top-k weights (T, k)
        in x's dtype, top-k expert ids (T, k))."""
        logits = F.linear(x2, local(self.gate.weight, partial_grad=True))
        probs = torch.softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x2.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        probs, weights, ids = self.route(x2)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token copies grouped by expert, in token order
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // self.top_k
        out = self.experts(x2, counts, token_of, weights.reshape(-1)[order])
        gate = F.linear(x2, local(self.shared_expert_gate.weight, partial_grad=True))
        shared = torch.sigmoid(gate) * self.shared_expert(x2)
        self.router_probs, self.router_topk, self.tokens_per_expert = probs, ids, counts.detach()
        return (out + shared).reshape(shape)


class MoeDecoderLayer(DecoderLayer):
    def _make_mlp(self, config: Any) -> Module:
        return SparseMoeBlock(config)


class MoeTextModel(TextModel):
    layer_cls = MoeDecoderLayer


def load_balancing_loss(blocks: list[SparseMoeBlock], num_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over the last forward of ``blocks``, as HF computes it:
    ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k assignments to expert ``e`` and ``P_e``
    its mean router probability, both over every layer's tokens (over every rank's tokens when the
    blocks' tokens are split over a ``token_mesh``)."""
    dtype = next((b.router_probs.dtype for b in blocks if b.router_probs is not None), torch.float32)
    counts = torch.zeros(num_experts, dtype=dtype)
    prob_sum = torch.zeros(num_experts, dtype=dtype)
    rows = 0
    for b in blocks:
        if b.router_probs is None or b.router_topk is None:
            raise RuntimeError("load_balancing_loss needs a forward first (no routing recorded)")
        probs = b.router_probs
        routed = torch.bincount(b.router_topk.reshape(-1), minlength=num_experts).to(dtype)
        counts = counts.to(probs.device) + routed
        prob_sum = prob_sum.to(probs.device) + probs.sum(dim=0)
        rows += probs.shape[0]
    mesh = next((b.token_mesh for b in blocks if b.token_mesh is not None), None)
    return balance_loss(counts, prob_sum, counts.new_tensor(float(rows)), mesh)


def balance_loss(counts: torch.Tensor, prob_sum: torch.Tensor, rows: torch.Tensor,
                 mesh: DeviceMesh | None) -> torch.Tensor:
    """``load_balancing_loss`` from its statistics: top-k assignments per expert ``counts`` (E,)
    and router probabilities summed per expert ``prob_sum`` (E,), both summed over the layers,
    over ``rows`` (a 0-d tensor) token rows of all the layers; each rank's own when ``mesh``
    (the blocks' ``token_mesh``) splits the tokens.  Only ``prob_sum`` carries a gradient."""
    num_experts = counts.shape[0]
    counts, rows = counts.detach(), rows.detach()
    if mesh is None:
        return num_experts * torch.sum((counts / rows) * (prob_sum / rows))
    # The loss is linear in each rank's probability sums once the counts are global, so every rank
    # adds its share; the counts and row total carry no gradient.
    totals = _sum_over(mesh, torch.cat([counts, rows.reshape(1)]))
    share = num_experts * torch.sum((totals[:-1] / totals[-1]) * (prob_sum / totals[-1]))
    return _sum_over(mesh, share)


def _sum_over(mesh: DeviceMesh, t: torch.Tensor) -> torch.Tensor:
    """Each rank's ``t`` summed over ``mesh`` (every dim of it), the same on every rank
    (differentiable)."""
    total: torch.Tensor = DTensor.from_local(t, mesh, [Partial()] * mesh.ndim, run_check=False).full_tensor()
    return total


class Qwen3_5MoeForCausalLM(BaseModel):
    """``input_ids`` (B, S) -> logits (B, S, vocab); ``aux_loss()`` is the router's load-balancing
    loss of the last forward (add ``config.router_aux_loss_coef * aux_loss()`` to the LM loss)."""

    Config = Qwen3_5MoeConfig

    def __init__(self, config: Qwen3_5MoeConfig) -> None:
        super().__init__(config)
        self.model = MoeTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def aux_loss(self) -> torch.Tensor:
        cfg: Qwen3_5MoeConfig = self.config  # type: ignore[assignment]
        return load_balancing_loss(self.moe_blocks(), cfg.num_experts)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy (position t predicts ``labels[t + 1]``; -100 ignored) plus the
        weighted load-balancing loss of the same forward, as HF's ``labels=`` loss."""
        cfg: Qwen3_5MoeConfig = self.config  # type: ignore[assignment]
        ce = F.cross_entropy(
            local(logits)[:, :-1].reshape(-1, logits.shape[-1]).to(compute_dtype(logits.dtype)),
            labels[:, 1:].reshape(-1), ignore_index=-100
        )
        return ce + cfg.router_aux_loss_coef * self.aux_loss()

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, int]:
        """Active parameters per token: the routed experts count ``top_k / num_experts`` of theirs."""
        cfg: Qwen3_5MoeConfig = self.config  # type: ignore[assignment]
        nparams, _ = super().get_nparams_and_flops(seq_len)
        expert = sum(p.numel() for b in self.moe_blocks() for p in b.experts.parameters())
        embed = self.model.embed_tokens.weight.numel()
        active = nparams - embed - expert + expert * cfg.num_experts_per_tok // cfg.num_experts
        n_full = sum(t == "full_attention" for t in (cfg.layer_types or []))
        return nparams, 6 * active + 12 * n_full * cfg.num_attention_heads * cfg.head_dim * seq_len


__all__ = ["GroupedExperts", "MoeDecoderLayer", "Qwen3_5MoeForCausalLM", "SparseMoeBlock", "balance_loss",
           "load_balancing_loss"]
