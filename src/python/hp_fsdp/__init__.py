"""hp_fsdp: fully sharded and hybrid-sharded data parallel (FSDP2's ``fully_shard``) on
hyper-parallel DTensors, composable with tensor parallelism."""

from hp_fsdp.clip_grad import clip_grad_norm_, clip_grads, clip_grads_with_norm_, get_total_norm
from hp_fsdp.fully_shard import FSDPModule, fully_shard
from hp_fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard",
    "clip_grad_norm_", "clip_grads", "clip_grads_with_norm_", "get_total_norm",
]
