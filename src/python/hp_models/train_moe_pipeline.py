"""The MoE model under pipeline parallelism in the trainer.

Each of this rank's stages (``hp_models.qwen3_5_moe.pipeline``) is parallelized in the trainer's
order: TP (sequence parallel, loss parallel on the last stage) and EP on the MoE meshes'
``pp`` slice, then the job's activation checkpointing, then FSDP (dense parameters over the
data-parallel ranks, the experts over ``efsdp``, or ``edp`` under expert TP).  The schedule is
the dense pipeline's (``PipelinedModel``); each microbatch's loss is its cross entropy plus
``router_aux_loss_coef`` times the load-balancing loss of the whole model's routing, which the
last stage reads from the statistics the stages passed along.  The step's routed token copies per
(layer, expert) come from the last stage's ranks (every layer's, of their tokens), summed over
the ranks with the losses in one all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_models.activation_checkpoint import checkpoint_model_blocks
from hp_models.job import TrainLayout
from hp_models.mixed_precision import fsdp_policy
from hp_models.qwen3_5.model import local
from hp_models.qwen3_5_moe.pipeline import Qwen3_5MoeStage, pipeline_qwen3_5_moe
from hp_models.train_moe import ExpertLoad, MoeMeshes
from hp_models.train_pipeline import PipelinedModel


class MoePipelinedModel(PipelinedModel):
    def __init__(self, model: Any, layout: TrainLayout, meshes: MoeMeshes) -> None:
        split = layout.split
        assert split is not None
        stages = pipeline_qwen3_5_moe(model, split, meshes.dense, lambda stage: _parallelize(stage, layout, meshes))
        super().__init__(model, layout, meshes.dense, stages)
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


def _parallelize(stage: Qwen3_5MoeStage, layout: TrainLayout, meshes: MoeMeshes) -> None:
    """TP and EP, activation checkpointing, FSDP of one stage module, in place."""
    from hp_models.qwen3_5_moe.fsdp import apply_fsdp_qwen3_5_moe
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe

    dims = layout.dims
    moe = layout.moe
    assert moe is not None
    tp_mesh = meshes.dense["tp"] if dims.tp > 1 else None
    parallelize_qwen3_5_moe(stage, tp_mesh=tp_mesh, ep_mesh=meshes.ep, etp_mesh=meshes.etp,
                            loss_parallel=dims.tp > 1, dispatcher=moe.dispatcher,
                            npu_nums_per_device=moe.npu_nums_per_device)
    stage.tp_mesh = tp_mesh  # the sequence-sharded activations between stages live on it
    checkpoint_model_blocks(stage, layout)  # after TP and EP (their collectives rerun in the recomputation)
    if dims.dp_shard > 1 or meshes.expert_dp.size() > 1:
        dense_dp = meshes.dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else meshes.dense["fsdp"]
        apply_fsdp_qwen3_5_moe(stage, dense_dp, meshes.expert_dp, reshard_after_forward=dims.reshard_after_forward,
                               sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload,
                               mp_policy=fsdp_policy(layout))


__all__ = ["MoePipelinedModel"]
