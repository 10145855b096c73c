"""Qwen3.5 cut into pipeline stages by layer (``hp_pp``).

Every rank builds the whole model with the same seed (so every stage starts from the weights of
one process), then keeps the modules of its virtual stages: the embedding on virtual stage 0, the
decoder layers ``split.layers[v]`` on stage ``v`` (held under their original index, so parameter
names are those of the whole model), the final norm and ``lm_head`` on the last stage.  With
``tie_word_embeddings`` the first and last stages each hold a copy of the shared matrix, declared
as the tied parameter ``embed_tokens`` so the schedule sums their gradients after backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hp_dtensor import DeviceMesh
from hp_pp import PipelineStage, StageSplit

TIED = "embed_tokens"


class _Body(nn.Module):
    """The ``model.`` part of a stage: what it holds of the embedding, the layers and the norm."""


class Qwen3_5Stage(nn.Module):
    """One virtual stage: ``input_ids`` (first stage) or hidden states in; hidden states or
    logits (last stage) out."""

    def __init__(self, full: Any, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.config = full.config
        self.model = _Body()
        if first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layers})
        self.model.rotary_emb = full.model.rotary_emb
        if last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body: Any = self.model
        seq = x.shape[1]
        if self.first:
            x = body.embed_tokens(x)
        cos, sin = body.rotary_emb(seq, x.dtype)
        for layer in body.layers.values():
            x = layer(x, cos, sin)
        if self.last:
            head: Any = self.lm_head
            x = head(body.norm(x))
        return x

    def tied_parameters(self) -> dict[str, Any]:
        body: Any = self.model
        head: Any = getattr(self, "lm_head", None)
        if not self.config.tie_word_embeddings:
            return {}
        if self.first:
            return {TIED: body.embed_tokens.weight}
        if self.last:
            return {TIED: head.weight}
        return {}


def split_qwen3_5(model: Any, split: StageSplit, pp_rank: int) -> list[Qwen3_5Stage]:
    """The stage modules pp rank ``pp_rank`` runs (its virtual stages in increasing order)."""
    if split.num_layers != model.config.num_hidden_layers:
        raise ValueError(
            f"the split places {split.num_layers} layers but the model has {model.config.num_hidden_layers}"
        )
    last = split.num_virtual - 1
    return [Qwen3_5Stage(model, split.layers[v], first=v == 0, last=v == last) for v in split.stages_of(pp_rank)]


def pipeline_qwen3_5(model: Any, split: StageSplit, mesh: DeviceMesh, *, pp_dim: str = "pp",
                     check_finite: bool = False) -> list[PipelineStage]:
    """``PipelineStage`` objects for this rank's virtual stages of ``model`` over ``mesh``'s pp dim."""
    names = mesh.mesh_dim_names or ()
    dim = names.index(pp_dim) if mesh.ndim > 1 else 0
    pp_rank = mesh.get_local_rank(dim)
    if mesh.size(dim) != split.pp:
        raise ValueError(f"the split is for pp={split.pp} but the mesh's pp dim has {mesh.size(dim)} ranks")
    chunks = split_qwen3_5(model, split, pp_rank)
    return [
        PipelineStage(c, v, split.num_virtual, mesh, pp_dim=pp_dim, tied_parameters=c.tied_parameters(),
                      check_finite=check_finite)
        for c, v in zip(chunks, split.stages_of(pp_rank))
    ]
