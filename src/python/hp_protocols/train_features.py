"""Job-file options of the training loop that are not parallelism: activation checkpointing (the
``activation_checkpoint:`` section) and the mixed-precision dtypes (``training.param_dtype``,
``training.reduce_dtype``).

The semantics are torchtitan's: ``mode: none | full | selective``; under ``selective``,
``selective_ac_option: "<k>"`` checkpoints every k-th transformer block (the k-th, 2k-th, ...
counted from 1).  The dtypes are those of FSDP2's ``MixedPrecisionPolicy``: parameters are
all-gathered and computed in ``param_dtype`` while the sharded master copy the optimizer steps
stays float32, and gradients are reduced in ``reduce_dtype``.  Pure: no framework; values are
read from YAML strings into enums here, so a wrong one fails when the job is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ActivationCheckpointMode(Enum):
    """Which transformer blocks recompute their forward in backward instead of keeping its
    activations: none, every block, or a selection (``selective_ac_option``)."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"

    @classmethod
    def parse(cls, value: object) -> ActivationCheckpointMode:
        if isinstance(value, cls):
            return value
        for mode in cls:
            if isinstance(value, str) and value.strip().lower() == mode.value:
                return mode
        raise ValueError(
            f"activation_checkpoint.mode must be one of {[m.value for m in cls]}, got {value!r}"
        )


class FloatDType(Enum):
    """A floating-point dtype a job can name for parameters or gradient reduction (float16 would
    need loss scaling, which this trainer does not do, so it is not offered)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @classmethod
    def parse(cls, value: object, field: str) -> FloatDType:
        if isinstance(value, cls):
            return value
        aliases = {"float32": cls.FLOAT32, "fp32": cls.FLOAT32, "bfloat16": cls.BFLOAT16, "bf16": cls.BFLOAT16}
        if isinstance(value, str) and value.strip().lower() in aliases:
            return aliases[value.strip().lower()]
        raise ValueError(
            f"training.{field} must be float32 (fp32) or bfloat16 (bf16), got {value!r}"
        )

    @property
    def itemsize(self) -> int:
        return 4 if self is FloatDType.FLOAT32 else 2


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    """The ``activation_checkpoint:`` section (torchtitan's fields)."""

    mode: ActivationCheckpointMode = ActivationCheckpointMode.NONE
    # under ``selective``: "<k>", checkpoint every k-th block (k >= 1; "1" is every block)
    selective_ac_option: str = "2"

    def __post_init__(self) -> None:
        self.mode = ActivationCheckpointMode.parse(self.mode)
        # a wrong option fails when the job is read, whatever the mode; YAML may give it as an int
        self.selective_ac_option = str(_every(self.selective_ac_option))

    @property
    def every(self) -> int:
        """k of ``selective_ac_option``: every k-th block is checkpointed under ``selective``."""
        return _every(self.selective_ac_option)

    def checkpointed(self, block_index: int) -> bool:
        """Whether block ``block_index`` (0-based, in the model's order) is checkpointed."""
        if self.mode is ActivationCheckpointMode.FULL:
            return True
        if self.mode is ActivationCheckpointMode.SELECTIVE:
            return (block_index + 1) % self.every == 0
        return False


def _every(option: object) -> int:
    text = str(option).strip() if isinstance(option, (str, int)) and not isinstance(option, bool) else None
    if text is None or not text.isdigit() or int(text) < 1:
        hint = " (op-level selective checkpointing is not built; give a block interval)" if text == "op" else ""
        raise ValueError(
            f"activation_checkpoint.selective_ac_option must be a positive integer k (checkpoint every k-th "
            f"block), got {option!r}{hint}"
        )
    return int(text)


__all__ = ["ActivationCheckpointConfig", "ActivationCheckpointMode", "FloatDType"]
