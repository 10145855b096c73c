"""The model on this rank: the seeded whole model, then parallelized in one composition order.

The order is torchtitan's: the pipeline split (each stage then parallelized on its own), tensor
parallelism with sequence parallelism, context parallelism, activation checkpointing
(``hp_models.activation_checkpoint``), then FSDP/HSDP over the data-parallel ranks
(``dp_shard * cp`` under context parallelism), with the job's mixed precision
(``hp_models.mixed_precision``).  The paths that need more than this module
live in their own: the pipeline (``hp_models.train_pipeline``, also with context parallelism
inside each stage), context parallelism (``hp_models.train_context``) and the mixture-of-experts
model (``hp_models.train_moe``).
"""

from __future__ import annotations

from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.args import Args


def build_model(args: Args, layout: TrainLayout, config: Any, *, distributed: bool) -> tuple[Any, int]:
    """The model with the seeded initial weights, then TP and FSDP applied as ``layout`` says
    (over the meshes built from it), and this rank's data-parallel index."""
    import torch

    from hp_models.activation_checkpoint import checkpoint_model_blocks
    from hp_models.mixed_precision import fsdp_policy, logits_in_float32
    from hp_models.qwen3_5 import apply_fsdp_qwen3_5, parallelize_qwen3_5_tp

    if layout.moe is not None:
        from hp_models.train_moe import build_moe_model

        return build_moe_model(args.seed, layout, config, distributed=distributed)
    torch.manual_seed(args.seed)
    model = config.build()
    model.init_weights()
    if not distributed:
        checkpoint_model_blocks(model, layout)
        return model, 0
    dims = layout.dims
    dense, _ = dims.build_mesh("cpu")  # (pp, dp_replicate, fsdp, tp)
    coord = dense.get_coordinate()
    assert coord is not None
    if layout.split is not None:  # (with context parallelism inside each stage when cp > 1)
        from hp_models.train_pipeline import PipelinedModel

        pipelined = PipelinedModel(model, layout, dense)
        return pipelined, pipelined.dp_rank
    if layout.cp > 1:
        from hp_models.train_context import ContextParallelModel

        cp_model = ContextParallelModel(model, layout, dense)
        return cp_model, cp_model.dp_rank
    if dims.tp > 1:
        parallelize_qwen3_5_tp(model, dense["tp"])
    checkpoint_model_blocks(model, layout)  # after TP (its hooks rerun in the recomputation), before FSDP
    if layout.uses_fsdp:
        dp_mesh = dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else dense["fsdp"]
        apply_fsdp_qwen3_5(model, dp_mesh, reshard_after_forward=dims.reshard_after_forward,
                           sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload,
                           mp_policy=fsdp_policy(layout))
        logits_in_float32(model, layout)
    return model, coord[1] * dims.dp_shard + coord[2]
