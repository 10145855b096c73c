"""Qwen3.5 cut into pipeline stages by layer (``hp_pp``).

Every rank builds the whole model with the same seed (so every stage starts from the weights of
one process), then keeps the modules of its virtual stages: the embedding on virtual stage 0, the
decoder layers ``split.layers[v]`` on stage ``v`` (held under their original index, so parameter
names are those of the whole model), the final norm and ``lm_head`` on the last stage.  With
``tie_word_embeddings`` the first and last stages each hold a copy of the shared matrix, declared
as the tied parameter ``embed_tokens`` so the schedule sums their gradients after backward.

On the dense mesh ``["pp", "dp_replicate", "fsdp", "tp"]`` each stage module is then
parallelized on its own (``parallelize_qwen3_5_stages``): the Qwen3.5 tensor-parallel plan
inside it, then ``fully_shard`` of its layers and of the stage (FSDP, or HSDP with replicas).
Between stages under TP the sequence-sharded activation travels as this rank's local shard and
is wrapped back into a ``Shard(1)`` DTensor on arrival.  Under context parallelism each stage
computes on its CP rank's share of the sequence and sends that share (``pipeline_cp``).  A tied embedding keeps one layout on
both ends (vocab rows split over tp, then over the data-parallel ranks), so the pipeline's sum
of the two copies' gradients adds matching shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, Shard
from hp_fsdp import MixedPrecisionPolicy
from hp_models.qwen3_5.fsdp import apply_fsdp_qwen3_5
from hp_models.qwen3_5.parallelize import parallelize_qwen3_5_tp
from hp_pp import PipelineConfigError, PipelineStage, StageSplit

if TYPE_CHECKING:
    from hp_cp import ContextParallel
    from hp_models.qwen3_5.pipeline_cp import MicrobatchFacts

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
        # Under tensor parallelism: the mesh the sequence-sharded activations between stages live on.
        self.tp_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body: Any = self.model
        if self.first:
            seq = x.shape[1]
            x = body.embed_tokens(x)
        else:
            if self.tp_mesh is not None:
                x = DTensor.from_local(x, self.tp_mesh, [Shard(1)])
            seq = x.shape[1]  # the whole sequence, also when sharded
        cos, sin = body.rotary_emb(seq, x.dtype)
        for layer in body.layers.values():
            x = layer(x, cos, sin)
        if self.last:
            head: Any = self.lm_head
            return head(body.norm(x))  # type: ignore[no-any-return]
        # the next stage receives a plain tensor: this rank's shard of the sequence
        return x.to_local() if isinstance(x, DTensor) else x

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


def split_qwen3_5(model: Any, split: StageSplit, pp_rank: int,
                  stage: type[Qwen3_5Stage] = Qwen3_5Stage) -> list[Qwen3_5Stage]:
    """The stage modules pp rank ``pp_rank`` runs (its virtual stages in increasing order), each a
    ``stage`` (a subclass for a model variant's stages)."""
    if split.num_layers != model.config.num_hidden_layers:
        raise ValueError(
            f"the split places {split.num_layers} layers but the model has {model.config.num_hidden_layers}"
        )
    last = split.num_virtual - 1
    return [stage(model, split.layers[v], first=v == 0, last=v == last) for v in split.stages_of(pp_rank)]


def _dim_size(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(name)) if name in names else 1


def parallelize_qwen3_5_stages(
    stages: Sequence[Qwen3_5Stage],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = False,
    sum_gradients: bool = False,
    cpu_offload: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    cp: ContextParallel | None = None,
    facts: MicrobatchFacts | None = None,
    before_fsdp: Callable[[Qwen3_5Stage], Any] | None = None,
) -> list[Qwen3_5Stage]:
    """Tensor, context and data parallelism inside this rank's stage modules, in place, over the
    dense mesh ``["pp", "dp_replicate", "fsdp", "tp"]`` (dims of size 1 or absent are skipped),
    in torchtitan's order: TP, CP, ``before_fsdp`` (the trainer's activation checkpointing),
    FSDP; returns them.

    ``tp`` > 1: the Qwen3.5 plan (sequence parallel, vocab-sharded ``lm_head`` for loss parallel)
    inside each stage; under ``cp`` without either (the sequence is split over the CP ranks
    already; the CP loss reduces whole-vocabulary logits).  ``cp`` (a ``ContextParallel`` over
    this stage's CP group, with ``facts``): each stage computes on its CP rank's share of the
    sequence (``hp_models.qwen3_5.pipeline_cp``); the CP ranks are part of the mesh's ``fsdp``
    dim (``dp_shard * cp``), so FSDP sums their gradient shares.  ``dp_replicate * fsdp`` > 1: ``fully_shard`` of each layer and of each
    stage over ``["dp_replicate", "fsdp"]`` (HSDP when ``dp_replicate`` > 1).  Under a pipeline
    schedule the gradients are then reduced once per step, in the backward of each stage's last
    microbatch, and ``reshard_after_forward=False`` (the default, as torchtitan under PP) keeps
    each stage's parameters gathered from its first forward to its last backward: one all_gather
    and one reduce_scatter per FSDP unit and step.  ``sum_gradients``: gradients summed over the
    data-parallel ranks instead of averaged (scale the loss by ``1 / dp``).  ``mp_policy``: the
    mixed-precision policy of every ``fully_shard`` (under bf16 parameters the activations the
    stages exchange, and the last stage's logits, are bf16).  Call it before wrapping
    the modules in ``PipelineStage`` (the tied parameter it names must be the sharded one)."""
    names = mesh.mesh_dim_names or ()
    unknown = sorted(set(names) - {"pp", "dp_replicate", "fsdp", "tp"})
    if unknown:
        raise PipelineConfigError(
            f"parallelize_qwen3_5_stages takes the dense mesh ['pp', 'dp_replicate', 'fsdp', 'tp']; this one has "
            f"dims {list(names)} ({unknown} unknown)"
        )
    tp = _dim_size(mesh, "tp")
    dp_replicate, fsdp = _dim_size(mesh, "dp_replicate"), _dim_size(mesh, "fsdp")
    out = list(stages)
    for stage in out:
        if not isinstance(stage, Qwen3_5Stage):
            raise TypeError(f"parallelize_qwen3_5_stages takes Qwen3_5Stage modules, got {type(stage).__name__}")
        if tp > 1:
            tp_mesh = mesh["tp"]
            if cp is None:
                parallelize_qwen3_5_tp(stage, tp_mesh)
            else:
                parallelize_qwen3_5_tp(stage, tp_mesh, sequence_parallel=False, loss_parallel=False)
            stage.tp_mesh = tp_mesh
        if cp is not None:
            from hp_models.qwen3_5.pipeline_cp import parallelize_qwen3_5_stage_cp

            if facts is None:
                raise ValueError("context parallelism inside pipeline stages needs the MicrobatchFacts they read")
            parallelize_qwen3_5_stage_cp(stage, cp, facts)
        if before_fsdp is not None:
            before_fsdp(stage)
        if dp_replicate * fsdp > 1:
            dp_mesh = mesh["dp_replicate", "fsdp"] if dp_replicate > 1 else mesh["fsdp"]
            apply_fsdp_qwen3_5(stage, dp_mesh, reshard_after_forward=reshard_after_forward,
                               sum_gradients=sum_gradients, cpu_offload=cpu_offload, mp_policy=mp_policy)
    return out


def pipeline_qwen3_5(model: Any, split: StageSplit, mesh: DeviceMesh, *, pp_dim: str = "pp",
                     check_finite: bool = False, reshard_after_forward: bool = False,
                     sum_gradients: bool = False, cpu_offload: bool = False,
                     mp_policy: MixedPrecisionPolicy | None = None, cp: ContextParallel | None = None,
                     facts: MicrobatchFacts | None = None,
                     before_fsdp: Callable[[Qwen3_5Stage], Any] | None = None) -> list[PipelineStage]:
    """``PipelineStage`` objects for this rank's virtual stages of ``model`` over ``mesh``'s pp dim.
    On the dense mesh ``["pp", "dp_replicate", "fsdp", "tp"]`` the stage modules are first
    parallelized by ``parallelize_qwen3_5_stages`` (the keyword arguments are its own)."""
    names = mesh.mesh_dim_names or ()
    dim = names.index(pp_dim) if mesh.ndim > 1 else 0
    pp_rank = mesh.get_local_rank(dim)
    if mesh.size(dim) != split.pp:
        raise ValueError(f"the split is for pp={split.pp} but the mesh's pp dim has {mesh.size(dim)} ranks")
    chunks = split_qwen3_5(model, split, pp_rank)
    if cp is not None and mesh.ndim == 1:
        raise ValueError("context parallelism inside pipeline stages needs the dense mesh, not a 1-D pp mesh")
    if mesh.ndim > 1:
        parallelize_qwen3_5_stages(chunks, mesh, reshard_after_forward=reshard_after_forward,
                                   sum_gradients=sum_gradients, cpu_offload=cpu_offload, mp_policy=mp_policy,
                                   cp=cp, facts=facts, before_fsdp=before_fsdp)
    elif before_fsdp is not None:
        for c in chunks:
            before_fsdp(c)
    return [
        PipelineStage(c, v, split.num_virtual, mesh, pp_dim=pp_dim, tied_parameters=c.tied_parameters(),
                      check_finite=check_finite)
        for c, v in zip(chunks, split.stages_of(pp_rank))
    ]
