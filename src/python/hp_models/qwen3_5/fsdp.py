"""Fully sharded data parallelism for Qwen3.5: ``fully_shard`` each decoder layer, then the root.

Each layer is one shard group (one all_gather before its forward, one reduce_scatter of its
gradients), so at most one layer's parameters are whole at a time when resharding after forward;
the root group holds the embedding, the final norm and ``lm_head``.  Apply it after the
tensor-parallel plan, with the data-parallel slice of the same mesh: a TP parameter is then
sharded over the data-parallel ranks on top of its TP split.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor import DeviceMesh
from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from hp_models.qwen3_5.model import decoder_layers


def apply_fsdp_qwen3_5(
    model: Any,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    sum_gradients: bool = False,
    cpu_offload: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Any:
    """Shard ``model`` in place over ``dp_mesh`` (1-D: FSDP; 2-D ``(dp_replicate, shard)``:
    HSDP); returns it.  ``reshard_after_forward`` applies to the layers (the root keeps its
    parameters gathered until backward, as in FSDP2).  ``sum_gradients``: reduce gradients by sum
    instead of mean over the data-parallel ranks; the caller then scales the loss."""
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model.model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                offload_policy=offload)
    if sum_gradients:
        model.set_gradient_divide_factor(1.0)
    return model
