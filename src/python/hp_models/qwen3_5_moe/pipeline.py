"""Qwen3.5-MoE cut into pipeline stages, with the router's load-balancing loss across them.

The load-balancing loss of a forward combines every layer's routing: ``E * sum_e (C_e / R) *
(P_e / R)`` with ``C_e`` the top-k assignments to expert ``e`` and ``P_e`` its summed router
probabilities, both over all the layers' ``R`` token rows.  A stage holds some of the layers, so
each microbatch's statistics travel with its activations: a stage adds its layers' assignments
per layer (no gradient), probability sums and rows to the statistics it received and sends them
on inside the same tensor as the hidden states (``pack``: extra rows after the sequence).  The
last stage's loss reads the whole model's statistics.  Its gradient with respect to the
probability sums, ``E * C_e / R^2`` (the global counts), travels back with the hidden states'
gradient through the same additions to every stage's routers; so the loss and its gradients are
those of one process, microbatch by microbatch, under any schedule.  The hidden states and the
statistics share a dtype: float32 (or float64), where the counts are exact.

When the stage's tokens are split over ranks (TP's sequence shards, CP's shares of the sequence)
each rank's statistics are those of its tokens, and the last stage sums them over those ranks
(``token_mesh``).  Under context parallelism (``context``) the stage computes on its CP rank's
share with the microbatch's sequence facts, as ``hp_models.qwen3_5.pipeline_cp``'s stages do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from hp_cp import ContextParallel
from hp_dtensor import DeviceMesh, DTensor, Replicate, Shard
from hp_models.qwen3_5.context_parallel import cp_rotary
from hp_models.qwen3_5.pipeline import Qwen3_5Stage, split_qwen3_5
from hp_models.qwen3_5.pipeline_cp import MicrobatchFacts
from hp_models.qwen3_5_moe.config import Qwen3_5MoeConfig
from hp_models.qwen3_5_moe.model import SparseMoeBlock, balance_loss
from hp_pp import PipelineStage, StageSplit


def statistics_size(config: Qwen3_5MoeConfig) -> int:
    """Elements of a microbatch's routing statistics: assignments per (layer, expert), probability
    sums per expert, rows."""
    return config.num_hidden_layers * config.num_experts + config.num_experts + 1


def pack(hidden: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """``hidden`` (B, S, H) with ``stats`` appended as ``ceil(n / (B * H))`` extra rows of each
    sample (zero-padded): one tensor for the pipeline to send."""
    if hidden.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"the MoE pipeline sends the router's token counts with the hidden states, exact in float32 or float64 "
            f"only; the hidden states are {hidden.dtype}: train the MoE model under pipeline parallelism in float32"
        )
    b, _, h = hidden.shape
    n = stats.numel()
    extra = -(-n // (b * h))
    tail = torch.cat([stats.to(hidden.dtype), stats.new_zeros(b * extra * h - n, dtype=hidden.dtype)])
    return torch.cat([hidden, tail.reshape(b, extra, h)], dim=1)


def unpack(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse: (hidden states, the ``n`` statistics)."""
    b, _, h = x.shape
    extra = -(-n // (b * h))
    return x[:, :-extra], x[:, -extra:].reshape(-1)[:n]


class Qwen3_5MoeStage(Qwen3_5Stage):
    """One virtual stage of the MoE model: ``input_ids`` (first stage) or packed hidden states
    and routing statistics in; packed ones, or logits (last stage) out.  The last stage keeps
    the microbatch's whole-model statistics as ``stats`` for the loss (``aux_loss``)."""

    def __init__(self, full: Any, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__(full, layers, first=first, last=last)
        self.stats: torch.Tensor | None = None
        # the ranks the stage's tokens are split over (TP, or CP and TP), whose statistics the loss sums
        self.token_mesh: DeviceMesh | None = None
        # under context parallelism: the CP group and the microbatches' sequence facts
        self.context: tuple[ContextParallel, MicrobatchFacts] | None = None
        # each layer's MoE block, found once (activation checkpointing may wrap the layer)
        self._blocks: list[tuple[int, SparseMoeBlock]] = [
            (i, next(m for m in full.model.layers[i].modules() if isinstance(m, SparseMoeBlock))) for i in layers
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body: Any = self.model
        cfg: Qwen3_5MoeConfig = self.config
        stats: torch.Tensor | None = None
        if self.first:
            h = body.embed_tokens(x)
        else:
            x, stats = unpack(x, statistics_size(cfg))
            if self.tp_mesh is not None:  # sequence parallel, or (under CP) replicated over tp
                h = DTensor.from_local(x, self.tp_mesh, [Replicate() if self.context else Shard(1)])
            else:
                h = x
        extra: dict[str, Any] = {}
        if self.context is not None:  # this CP rank's share of the microbatch's sequence
            cp, facts = self.context
            tokens = facts.take(self)
            if tokens.seq_len != x.shape[1] * cp.cp:
                raise ValueError(
                    f"the stage's input holds {x.shape[1]} tokens per row but the microbatch's sequence of "
                    f"{tokens.seq_len} over context_parallel {cp.cp} gives {tokens.seq_len // cp.cp}"
                )
            cos, sin = cp_rotary(body.rotary_emb, cp, tokens, x, h.dtype)
            extra["tokens"] = tokens
        else:
            cos, sin = body.rotary_emb(h.shape[1], h.dtype)  # the whole sequence, also when sharded
        blocks = dict(self._blocks)
        for name, layer in body.layers.items():
            h = layer(h, cos, sin, **extra)
            mine = _layer_statistics(blocks[int(name)], int(name), cfg)
            stats = mine if stats is None else stats + mine.to(stats.dtype)
        assert stats is not None
        if self.last:
            self.stats = stats
            head: Any = self.lm_head
            return head(body.norm(h))  # type: ignore[no-any-return]
        return pack(h.to_local() if isinstance(h, DTensor) else h, stats)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the microbatch the last stage's forward just ran (summed
        over ``token_mesh``, the ranks that route shares of its tokens)."""
        if self.stats is None:
            raise RuntimeError("aux_loss needs a forward of the last stage first")
        cfg: Qwen3_5MoeConfig = self.config
        e, lay = cfg.num_experts, cfg.num_hidden_layers
        counts = self.stats[:lay * e].reshape(lay, e).sum(dim=0)
        return balance_loss(counts, self.stats[lay * e:lay * e + e], self.stats[-1], self.token_mesh)

    def expert_counts(self) -> torch.Tensor:
        """The last forward's assignments per (layer, expert) of this rank's tokens, every layer."""
        assert self.stats is not None
        cfg: Qwen3_5MoeConfig = self.config
        return self.stats[:cfg.num_hidden_layers * cfg.num_experts].detach().reshape(cfg.num_hidden_layers, -1)


def _layer_statistics(block: SparseMoeBlock, index: int, cfg: Qwen3_5MoeConfig) -> torch.Tensor:
    probs, counts = block.router_probs, block.tokens_per_expert
    assert probs is not None and counts is not None
    e, lay = cfg.num_experts, cfg.num_hidden_layers
    per_layer = probs.new_zeros(lay, e)
    per_layer[index] = counts.to(probs.dtype)
    return torch.cat([per_layer.reshape(-1), probs.sum(dim=0), probs.new_tensor([float(probs.shape[0])])])


def split_qwen3_5_moe(model: Any, split: StageSplit, pp_rank: int) -> list[Qwen3_5MoeStage]:
    """The stage modules pp rank ``pp_rank`` runs (its virtual stages in increasing order)."""
    return cast(list[Qwen3_5MoeStage], split_qwen3_5(model, split, pp_rank, Qwen3_5MoeStage))


def pipeline_qwen3_5_moe(model: Any, split: StageSplit, mesh: DeviceMesh,
                         parallelize: Callable[[Qwen3_5MoeStage], Any]) -> list[PipelineStage]:
    """``PipelineStage`` objects for this rank's virtual stages of the MoE ``model`` over the
    dense mesh's ``pp`` dim; ``parallelize`` applies TP, EP, activation checkpointing and FSDP
    to each stage module in place first."""
    names = mesh.mesh_dim_names or ()
    dim = names.index("pp")
    pp_rank = mesh.get_local_rank(dim)
    if mesh.size(dim) != split.pp:
        raise ValueError(f"the split is for pp={split.pp} but the mesh's pp dim has {mesh.size(dim)} ranks")
    chunks = split_qwen3_5_moe(model, split, pp_rank)
    for c in chunks:
        parallelize(c)
    return [PipelineStage(c, v, split.num_virtual, mesh, tied_parameters=c.tied_parameters())
            for c, v in zip(chunks, split.stages_of(pp_rank))]


__all__ = ["Qwen3_5MoeStage", "pack", "pipeline_qwen3_5_moe", "split_qwen3_5_moe", "statistics_size", "unpack"]
