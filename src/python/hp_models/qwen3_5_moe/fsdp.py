"""Fully sharded data parallelism for the Qwen3.5 MoE model: dense parameters over the dense
mesh's data-parallel dims, routed experts over the sparse mesh's ``efsdp`` dim.

Apply after ``parallelize_qwen3_5_moe``.  Each MoE block's experts are their own shard group on
``efsdp`` (an expert parameter is then a DTensor over ``(ep, efsdp)``); each decoder layer's other
parameters and then the root are shard groups on the dense data-parallel mesh, as for the dense
model.  An expert's gradient already holds the tokens of its whole ep group, so after the sum over
``efsdp`` it holds every data-parallel rank's tokens: it is divided by the dense data-parallel
size, exactly like the dense gradients' mean.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor import DeviceMesh
from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from hp_models.qwen3_5.model import decoder_layers


def apply_fsdp_qwen3_5_moe(
    model: Any,
    dp_mesh: DeviceMesh,
    efsdp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    sum_gradients: bool = False,
    cpu_offload: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Any:
    """Shard ``model`` in place: experts over ``efsdp_mesh`` (the sparse mesh's ``efsdp`` dim;
    2-D ``(dp_replicate, efsdp)`` for HSDP), everything else over ``dp_mesh`` (1-D: FSDP; 2-D
    ``(dp_replicate, shard)``: HSDP).  Gradients are means over the dense data-parallel ranks, or
    sums with ``sum_gradients`` (the caller then scales the loss).  Returns ``model``."""
    if efsdp_mesh.ndim not in (1, 2) or efsdp_mesh.ndim != dp_mesh.ndim:
        raise ValueError(
            f"apply_fsdp_qwen3_5_moe needs an efsdp mesh of the dense data-parallel mesh's dims ("
            f"{dp_mesh.ndim}: {dp_mesh.mesh_dim_names}), got {efsdp_mesh.ndim} dims {efsdp_mesh.mesh_dim_names}; pass "
            f"sparse_mesh['efsdp'], or sparse_mesh['dp_replicate', 'efsdp'] with replicas"
        )
    dp_size = dp_mesh.size()
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    layers: list[Any] = decoder_layers(model.model)  # (a pipeline stage holds some, by their index)
    experts: list[Any] = [layer.mlp.experts for layer in layers]
    for layer, ex in zip(layers, experts):
        fully_shard(ex, mesh=efsdp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                offload_policy=offload)
    if sum_gradients:
        model.set_gradient_divide_factor(1.0)  # every group, the experts' included
    else:
        for ex in experts:
            ex.set_gradient_divide_factor(float(dp_size))
    return model


__all__ = ["apply_fsdp_qwen3_5_moe"]
