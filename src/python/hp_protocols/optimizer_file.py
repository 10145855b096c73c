"""A MindFormers job file's ``optimizer:`` and ``lr_schedule:`` sections, as ``training:`` fields.

MindFormers writes the optimizer and the learning-rate schedule in sections of their own::

    optimizer:    {type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, weight_decay: 0.0}
    lr_schedule:  {type: CosineWithWarmUpLR, learning_rate: 1.e-5, lr_end: 1.e-6,
                   warmup_ratio: 0.01, warmup_steps: 0, total_steps: -1}

This trainer's schedule is a linear warmup to the peak rate, then a half-cosine or linear decay to
``lr_min`` (or no decay), so the sections map onto the ``training:`` fields of that schedule and
of AdamW: ``learning_rate`` (either section's) -> ``learning_rate``; ``lr_end`` -> ``lr_min``;
``warmup_steps`` -> ``lr_warmup_steps``; ``warmup_ratio`` -> ``lr_warmup_steps = int(ratio *
total_steps)`` (MindFormers' rule; with ``total_steps: -1`` the run's steps: ``lr_warmup_ratio``);
``total_steps`` > 0 -> the decay ends there (``lr_decay_steps = total_steps - warmup``);
``CosineWithWarmUpLR`` / ``LinearWithWarmUpLR`` / ``ConstantWarmUpLR`` -> ``lr_decay`` cosine /
linear / none; ``betas``, ``eps``, ``weight_decay`` -> ``adam_betas``, ``adam_eps``,
``weight_decay``.  MindFormers' ``warmup_lr_init`` and ``num_cycles`` are accepted at their
defaults (0 and 0.5, the shape built here) and refused otherwise.

Fail closed: a key not listed here raises (naming the nearest known key), as does an unsupported
``type`` (naming the supported ones), a value out of range, and a setting given twice with
different values (in both sections, or here and in ``training:``).  Pure: no framework.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from enum import Enum
from typing import Any


class OptimizerType(Enum):
    """The optimizers a job file's ``optimizer.type`` may name (MindFormers' spelling)."""

    ADAMW = "AdamW"


class LRScheduleType(Enum):
    """The schedules a job file's ``lr_schedule.type`` may name (MindFormers' spelling), and the
    decay after the warmup each one is here."""

    COSINE = "CosineWithWarmUpLR"
    LINEAR = "LinearWithWarmUpLR"
    CONSTANT = "ConstantWarmUpLR"

    @property
    def decay(self) -> str:
        """The ``training.lr_decay`` value of this schedule."""
        return {LRScheduleType.COSINE: "cosine", LRScheduleType.LINEAR: "linear",
                LRScheduleType.CONSTANT: "none"}[self]


OPTIMIZER_KEYS = ("type", "betas", "eps", "weight_decay", "learning_rate")
LR_SCHEDULE_KEYS = ("type", "learning_rate", "lr_end", "warmup_ratio", "warmup_steps", "total_steps",
                    "warmup_lr_init", "num_cycles")
# MindFormers' defaults of the keys accepted only at them: the shape this trainer builds
_ONLY_DEFAULT = {"warmup_lr_init": 0.0, "num_cycles": 0.5}


def _kind(enum: type[Enum], value: object, where: str) -> Any:
    for member in enum:
        if isinstance(value, str) and value.strip().lower() == str(member.value).lower():
            return member
    supported = [m.value for m in enum]
    near = difflib.get_close_matches(str(value), supported, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"{where} {value!r} is not supported{hint}; supported: {supported}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: object, where: str) -> float:
    if not _number(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{where} must be a number > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _non_negative(value: object, where: str) -> float:
    if not _number(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{where} must be a number >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _put(fields: dict[str, Any], key: str, value: Any, where: str) -> None:
    if key in fields and fields[key] != value:
        raise ValueError(f"the job gives {key} twice with different values ({fields[key]!r} and {where} = "
                         f"{value!r}); keep one")
    fields[key] = value


def optimizer_fields(section: Mapping[str, Any]) -> dict[str, Any]:
    """The ``training:`` fields of an ``optimizer:`` section (keys already checked)."""
    out: dict[str, Any] = {}
    if not section:
        return out
    if "type" not in section:
        raise ValueError(f"optimizer.type is missing; supported: {[m.value for m in OptimizerType]}")
    _kind(OptimizerType, section["type"], "optimizer.type")
    if "learning_rate" in section:
        out["learning_rate"] = _positive(section["learning_rate"], "optimizer.learning_rate")
    if "betas" in section:
        betas = section["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(
                _number(b) and 0 <= b < 1 for b in betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {betas!r}")
        out["adam_betas"] = (float(betas[0]), float(betas[1]))
    if "eps" in section:
        out["adam_eps"] = _positive(section["eps"], "optimizer.eps")
    if "weight_decay" in section:
        out["weight_decay"] = _non_negative(section["weight_decay"], "optimizer.weight_decay")
    return out


def lr_schedule_fields(section: Mapping[str, Any]) -> dict[str, Any]:
    """The ``training:`` fields of an ``lr_schedule:`` section (keys already checked)."""
    out: dict[str, Any] = {}
    if not section:
        return out
    if "type" not in section:
        raise ValueError(f"lr_schedule.type is missing; supported: {[m.value for m in LRScheduleType]}")
    kind: LRScheduleType = _kind(LRScheduleType, section["type"], "lr_schedule.type")
    out["lr_decay"] = kind.decay
    for key, default in _ONLY_DEFAULT.items():
        if key in section and section[key] is not None and section[key] != default:
            raise ValueError(f"lr_schedule.{key} {section[key]!r} is not built in this trainer (its schedule has "
                             f"{key} {default}); remove the key or set it to {default}")
    if "learning_rate" in section:
        out["learning_rate"] = _positive(section["learning_rate"], "lr_schedule.learning_rate")
    if section.get("lr_end") is not None:
        lr_end = _non_negative(section["lr_end"], "lr_schedule.lr_end")
        if kind is LRScheduleType.CONSTANT and lr_end != 0:
            raise ValueError(f"lr_schedule.lr_end {lr_end} with type {kind.value}: a constant schedule does not "
                             f"decay; remove lr_end or pick {LRScheduleType.COSINE.value} / "
                             f"{LRScheduleType.LINEAR.value}")
        out["lr_min"] = lr_end
    total = section.get("total_steps")
    if total is not None and total != -1 and (not isinstance(total, int) or isinstance(total, bool) or total < 1):
        raise ValueError(f"lr_schedule.total_steps must be a positive int or -1 (the run's steps), got {total!r}")
    total = None if total in (None, -1) else total
    warmup = section.get("warmup_steps")
    if warmup is not None and (not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0):
        raise ValueError(f"lr_schedule.warmup_steps must be an int >= 0, got {warmup!r}")
    ratio = section.get("warmup_ratio")
    if ratio is not None:
        if not _number(ratio) or not 0 <= ratio <= 1:
            raise ValueError(f"lr_schedule.warmup_ratio must be a number in [0, 1] (the share of the steps that "
                             f"warm up), got {ratio!r}")
        if warmup:
            raise ValueError(f"lr_schedule gives both warmup_steps {warmup} and warmup_ratio {ratio}; keep one "
                             f"(or set warmup_steps: 0)")
        if total is None:
            out["lr_warmup_ratio"] = float(ratio)  # of the run's steps, known when it starts
            return out
        warmup = int(ratio * total)  # MindFormers' rounding: down
    if warmup is not None:
        out["lr_warmup_steps"] = warmup
    if total is not None and kind is not LRScheduleType.CONSTANT:
        span = total - (warmup or 0)
        if span < 1:
            raise ValueError(f"lr_schedule.total_steps {total} leaves no step after the warmup of {warmup} to decay "
                             f"over; raise total_steps or shorten the warmup")
        out["lr_decay_steps"] = span
    return out


def training_fields(optimizer: Mapping[str, Any], lr_schedule: Mapping[str, Any]) -> dict[str, Any]:
    """The ``training:`` fields both sections give (see the module's docstring); ``ValueError``
    naming a bad value, or a learning rate the two sections give differently."""
    fields = optimizer_fields(optimizer)
    for key, value in lr_schedule_fields(lr_schedule).items():
        _put(fields, key, value, f"lr_schedule's {key}")
    return fields


def merge_into_training(training: dict[str, Any], fields: Mapping[str, Any]) -> None:
    """Add ``fields`` (from ``training_fields``) to a ``training:`` section in place; a field
    it already gives with another value raises (one setting, two values)."""
    for key, value in fields.items():
        have = training.get(key)
        if key in training and have != value and not (isinstance(have, list) and tuple(have) == value):
            raise ValueError(f"the job gives training.{key} {have!r} and, from its optimizer: / lr_schedule: "
                             f"section, {value!r}; keep one")
        training[key] = value


__all__ = ["LR_SCHEDULE_KEYS", "OPTIMIZER_KEYS", "LRScheduleType", "OptimizerType", "lr_schedule_fields",
           "merge_into_training", "optimizer_fields", "training_fields"]
