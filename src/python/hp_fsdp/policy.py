"""The knobs of ``fully_shard``: mixed precision and parameter offload, as in FSDP2."""

from __future__ import annotations

from dataclasses import dataclass

# A framework dtype (``torch.bfloat16``, ``mindspore.bfloat16``); None keeps the parameter's own.
DType = object


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How a sharded module computes and communicates.

    ``param_dtype``: dtype of the all-gathered (unsharded) parameters the forward and backward
    use; the sharded parameters the optimizer steps stay in their own dtype (master weights).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (default ``param_dtype``); the reduced
    gradient is cast back to the parameter's dtype.  ``output_dtype``: floating-point outputs of
    the module's forward are cast to it.  ``cast_forward_inputs``: floating-point inputs are cast
    to ``param_dtype``."""

    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    output_dtype: DType | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients (so the optimizer step) in host memory; each
    all_gather copies the shard to the device first and each reduced gradient shard comes back.
    On a CPU-only job there is nothing to offload: ``fully_shard`` warns and keeps everything
    where it is."""

    pin_memory: bool = True
