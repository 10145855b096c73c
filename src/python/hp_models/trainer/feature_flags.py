"""The trainer's flags for activation checkpointing and mixed precision, and the job overrides
they make (``--activation-checkpoint``, ``--ac-every``, ``--mixed-precision``).  Pure: no
framework; the checks that need the whole job (``--ac-every`` without ``selective``, bf16 without
data-parallel sharding) are ``hp_models.job.plan``'s."""

from __future__ import annotations

import argparse
from typing import Any

from hp_protocols import ActivationCheckpointMode, FloatDType

# --mixed-precision: bf16 computes in bfloat16 (gradients reduced as the job says, float32 by
# default); none is float32 everywhere
_MIXED = {"bf16": FloatDType.BFLOAT16, "none": FloatDType.FLOAT32}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (checkpoint every k-th block), got {text!r}")
    return value


def add_feature_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activation-checkpoint", choices=[m.value for m in ActivationCheckpointMode], default=None,
                   help="recompute transformer blocks in backward instead of keeping their activations: none, "
                        "full (every block) or selective (every --ac-every-th block); default: the job's "
                        "activation_checkpoint.mode, else none")
    p.add_argument("--ac-every", type=_positive, default=None,
                   help="with --activation-checkpoint selective: checkpoint every K-th block (selective_ac_option; "
                        "default 2)")
    p.add_argument("--mixed-precision", choices=sorted(_MIXED), default=None,
                   help="bf16: parameters gathered and computed in bfloat16, gradients reduced in the job's "
                        "reduce_dtype (default float32), float32 master weights; none: float32 everywhere; "
                        "default: the job's training.param_dtype. Needs data-parallel sharding")


def feature_overrides(activation_checkpoint: str | None, ac_every: int | None,
                      mixed_precision: str | None) -> dict[str, Any]:
    """``hp_models.job.Overrides`` keyword arguments of the flags given (None: keep the job's)."""
    return {
        "activation_checkpoint": (ActivationCheckpointMode.parse(activation_checkpoint)
                                  if activation_checkpoint is not None else None),
        "ac_every": ac_every,
        "param_dtype": _MIXED[mixed_precision] if mixed_precision is not None else None,
    }


__all__ = ["add_feature_flags", "feature_overrides"]
