"""bf16 mixed precision from the job file: the ``MixedPrecisionPolicy`` that ``fully_shard`` applies.

FSDP2's semantics: the sharded parameters the optimizer steps (master weights) and their
gradients stay float32; each block's parameters are all-gathered in ``param_dtype`` and its
forward and backward compute in it; gradients are reduce-scattered in ``reduce_dtype`` and cast
back to float32.  The model's floating-point output (the logits) is cast to float32, so the loss
and its softmax are computed in float32 (as torchtitan does).  Mixed precision is applied by
``fully_shard``, so it needs data-parallel sharding (``check_mixed_precision``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hp_fsdp import MixedPrecisionPolicy
from hp_protocols import FloatDType

if TYPE_CHECKING:
    from hp_models.job import TrainLayout

_TORCH = {FloatDType.FLOAT32: torch.float32, FloatDType.BFLOAT16: torch.bfloat16}


def torch_dtype(dtype: FloatDType) -> torch.dtype:
    return _TORCH[dtype]


def is_mixed(param_dtype: FloatDType, reduce_dtype: FloatDType) -> bool:
    """Anything other than float32 everywhere (the plain run)."""
    return param_dtype is not FloatDType.FLOAT32 or reduce_dtype is not FloatDType.FLOAT32


def mixed_precision_policy(param_dtype: FloatDType, reduce_dtype: FloatDType) -> MixedPrecisionPolicy | None:
    """The policy for ``fully_shard`` (None: float32 everywhere, ``fully_shard``'s default)."""
    if not is_mixed(param_dtype, reduce_dtype):
        return None
    return MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))


def fsdp_policy(layout: TrainLayout) -> MixedPrecisionPolicy | None:
    """The policy of the job's ``param_dtype`` / ``reduce_dtype`` for the blocks' ``fully_shard``."""
    return mixed_precision_policy(layout.param_dtype, layout.reduce_dtype)


def logits_in_float32(model: Any, layout: TrainLayout) -> None:
    """Under mixed precision, cast the model's floating-point output (the logits, a DTensor under
    tensor parallelism) to float32 after its forward, so the loss is computed in float32."""
    if not is_mixed(layout.param_dtype, layout.reduce_dtype):
        return

    def cast(_module: Any, _args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dtype != torch.float32:
            return output.float()
        return output

    model.register_forward_hook(cast)


__all__ = ["fsdp_policy", "is_mixed", "logits_in_float32", "mixed_precision_policy", "torch_dtype"]
