"""The MoE model under pipeline parallelism in the trainer.

Each of this rank's stages (``hp_models.qwen3_5_moe.pipeline``) is parallelized in the trainer's
order: TP (sequence parallel, loss parallel on the last stage; neither under CP) and EP on the
MoE meshes' ``pp`` slice, then context parallelism of its layers (the stage reads each
microbatch's sequence facts), then the job's activation checkpointing, then FSDP (dense
parameters over ``dp_shard * cp``, the experts over ``efsdp``, or ``edp`` under expert TP).
Under CP the router's statistics of a microbatch are summed over its CP and TP ranks.  The schedule is
the dense pipeline's (``PipelinedModel``); each microbatch's loss is its cross entropy plus
``router_aux_loss_coef`` times the load-balancing loss of the whole model's routing, which the
last stage reads from the statistics the stages passed along.  The step's routed token copies per
(layer, expert) come from the last stage's ranks (every layer's, of their tokens), summed over
the ranks with the losses in one all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_cp import ContextParallel
from hp_dtensor import DeviceMesh
from hp_models.activation_checkpoint import checkpoint_model_blocks
from hp_models.job import TrainLayout
from hp_models.mixed_precision import fsdp_policy
from hp_models.qwen3_5.model import local
from hp_models.qwen3_5.pipeline_cp import MicrobatchFacts
from hp_models.qwen3_5_moe.pipeline import Qwen3_5MoeStage, pipeline_qwen3_5_moe
from hp_models.train_moe import ExpertLoad, MoeMeshes
from hp_models.train_pipeline import PipelinedModel
from hp_pp import PipelineStage


class MoePipelinedModel(PipelinedModel):
    def __init__(self, model: Any, layout: TrainLayout, meshes: MoeMeshes) -> None:
        split = layout.split
        assert split is not None
        stages: list[PipelineStage] = []

        def build(cp: ContextParallel | None, facts: MicrobatchFacts | None) -> list[PipelineStage]:
            tokens = _token_mesh(layout, meshes) if cp is not None else None
            stages.extend(pipeline_qwen3_5_moe(model, split, meshes.dense,
                                               lambda stage: _parallelize(stage, layout, meshes, cp, facts, tokens)))
            return stages

        super().__init__(model, layout, meshes.dense, build)
        self._coef: float = model.config.router_aux_loss_coef
        self._heads: list[Qwen3_5MoeStage] = [s.module for s in stages if s.is_last]
        self.expert_load = ExpertLoad(model.config.num_hidden_layers, model.config.num_experts)

    def _objective(self, logits: Any, target: Any) -> Any:
        # under TP the cross entropy is a replicated scalar: this rank's value, to add the router's loss
        ce = local(super()._objective(logits, target))
        head = self._heads[0]
        self.expert_load.add_counts(head.expert_counts())
        return ce + self._coef * head.aux_loss()

    def train_step(self, dp_rank: int, ids: torch.Tensor, tgt: torch.Tensor) -> float:
        """The pipeline's step (``PipelinedModel.train_step``); every rank's counts table starts
        at zero (only the last stage's ranks add theirs)."""
        load = self.expert_load
        load.add_counts(torch.zeros(load.layers, load.experts))
        return super().train_step(dp_rank, ids, tgt)

    def _sum_over_ranks(self, local_loss: float) -> float:
        return self.expert_load.end_step(local_loss, self._layout.world_size)


def _token_mesh(layout: TrainLayout, meshes: MoeMeshes) -> DeviceMesh:
    """The ranks splitting a stage's tokens under context parallelism: the CP group (hybrid's two
    dims as one) and, under TP, its TP ranks (each MoE block routes its TP rank's share)."""
    from hp_dtensor import init_device_mesh

    d = layout.dims
    whole = init_device_mesh("cpu", (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp),
                             mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return whole["cp", "tp"] if d.tp > 1 else whole["cp"]


def _parallelize(stage: Qwen3_5MoeStage, layout: TrainLayout, meshes: MoeMeshes, cp: ContextParallel | None,
                 facts: MicrobatchFacts | None, tokens: DeviceMesh | None) -> None:
    """TP and EP, CP, activation checkpointing, FSDP of one stage module, in place."""
    from hp_models.qwen3_5.context_parallel import parallelize_layers_cp
    from hp_models.qwen3_5_moe.fsdp import apply_fsdp_qwen3_5_moe
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe

    dims = layout.dims
    moe = layout.moe
    assert moe is not None
    tp_mesh = meshes.dense["tp"] if dims.tp > 1 else None
    # under CP: no sequence parallelism (the blocks still split their tokens over tp) and the
    # logits whole over the vocab (the CP loss reduces over the CP ranks itself)
    parallelize_qwen3_5_moe(stage, tp_mesh=tp_mesh, ep_mesh=meshes.ep, etp_mesh=meshes.etp,
                            loss_parallel=dims.tp > 1 and cp is None, sequence_parallel=cp is None,
                            context_parallel=dims.cp, dispatcher=moe.dispatcher,
                            npu_nums_per_device=moe.npu_nums_per_device)
    stage.tp_mesh = tp_mesh  # the activations between stages live on it
    stage.token_mesh = tp_mesh
    if cp is not None:
        assert facts is not None and tokens is not None
        body: Any = stage.model
        parallelize_layers_cp(list(body.layers.values()), cp)
        stage.context = (cp, facts)
        stage.token_mesh = tokens
    checkpoint_model_blocks(stage, layout)  # after TP, EP and CP (their collectives rerun in the recomputation)
    if dims.dp_shard * dims.cp > 1 or meshes.expert_dp.size() > 1:
        dense_dp = meshes.dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else meshes.dense["fsdp"]
        apply_fsdp_qwen3_5_moe(stage, dense_dp, meshes.expert_dp, reshard_after_forward=dims.reshard_after_forward,
                               sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload,
                               mp_policy=fsdp_policy(layout))


__all__ = ["MoePipelinedModel"]
