"""The model on a MindSpore rank: the torch trainer's initial weights in the MindSpore Qwen3.5,
then tensor parallelism, then FSDP/HSDP, in the torch trainer's composition order.

Tensor parallelism is the model's own plan (``parallelize_qwen3_5_ms_tp``: ShardingConfigs on
the protocol Modules) with sequence parallelism and loss parallel, as the torch trainer's; FSDP
shards each decoder layer as one group and the root (embedding, final norm, ``lm_head``) as
another, over ``fsdp`` (FSDP) or ``(dp_replicate, fsdp)`` (HSDP) of the job's mesh.
"""

from __future__ import annotations

from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.mindspore.weights import read_initial_state, set_initial_weights


def build_model_ms(weights: str, layout: TrainLayout, config: Any, *, distributed: bool) -> tuple[Any, int]:
    """The parallelized model, starting from the weights in ``weights`` (``initial_state_file``'s),
    and this rank's data-parallel index."""
    from hp_fsdp import fully_shard
    from hp_models.qwen3_5.mindspore import Qwen3_5ForCausalLM, parallelize_qwen3_5_ms_tp

    model = Qwen3_5ForCausalLM(config)
    set_initial_weights(model, read_initial_state(weights))
    if not distributed:
        return model, 0
    dims = layout.dims
    dense, _ = dims.build_mesh("cpu")  # (pp, dp_replicate, fsdp, tp)
    coord = dense.get_coordinate()
    assert coord is not None
    if dims.tp > 1:
        parallelize_qwen3_5_ms_tp(model, dense["tp"], sequence_parallel=True, loss_parallel=True)
    if layout.uses_fsdp:
        dp_mesh = dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else dense["fsdp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=dims.reshard_after_forward)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=dims.reshard_after_forward)
        if layout.sum_gradients:
            model.set_gradient_divide_factor(1.0)
    return model, coord[1] * dims.dp_shard + coord[2]
