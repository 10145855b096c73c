"""Which framework trains (``--backend``, else ``HYPER_PARALLEL_PLATFORM``, else torch), and what
the MindSpore backend refuses before any rank starts.

The MindSpore backend (``hp_models.trainer.mindspore``) runs the main job: the dense model with
tensor parallelism, FSDP and HSDP (``dp_shard``, ``dp_replicate``), gradient accumulation, the
learning-rate schedule, gradient clipping, the metrics and outputs, and checkpoints in the
safetensors-shards format (which torch writes and reads too).  A job asking for a feature
only the torch backend has yet is refused with one ``NotImplementedError`` naming every such
feature and saying to use the torch backend.  Pure: no framework is imported.
"""

from __future__ import annotations

import importlib.util
import os
from enum import Enum

from hp_checkpoint.manifest import CheckpointKind
from hp_cp.config import MaskCompression
from hp_models.job import TrainLayout
from hp_protocols import ActivationCheckpointMode, FloatDType


class Backend(Enum):
    TORCH = "torch"
    MINDSPORE = "mindspore"

    @classmethod
    def resolve(cls, flag: str | None) -> Backend:
        """``flag`` (``--backend``), else the ``HYPER_PARALLEL_PLATFORM`` variable, else torch;
        ``ValueError`` naming an unknown value."""
        value = flag if flag is not None else os.environ.get("HYPER_PARALLEL_PLATFORM") or cls.TORCH.value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown backend {value!r} (HYPER_PARALLEL_PLATFORM or --backend): "
                             f"choose one of {[b.value for b in cls]}") from None


def launcher_world(backend: Backend) -> tuple[str | None, str]:
    """(the world size a launcher set, the variable that says it): torchrun's ``WORLD_SIZE``, or
    msrun's ``MS_WORKER_NUM`` on a MindSpore worker; (None, "") when the trainer starts the ranks."""
    if backend is Backend.MINDSPORE:
        if os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED"):
            return os.environ.get("MS_WORKER_NUM"), "MS_WORKER_NUM"
        return None, ""
    return os.environ.get("WORLD_SIZE"), "WORLD_SIZE"


def mindspore_gaps(layout: TrainLayout, *, checkpoint_format: CheckpointKind | None, torchrun: bool) -> list[str]:
    """The features this job asks for that the MindSpore backend does not have yet."""
    gaps = []
    if checkpoint_format is CheckpointKind.DCP:
        # DCP is torch.distributed.checkpoint's own file format and planner, which MindSpore lacks
        gaps.append("DCP checkpoints (--checkpoint-format dcp, torch.distributed.checkpoint's files; drop the flag: "
                    "MindSpore writes and resumes safetensors-shards checkpoints, which torch resumes too)")
    if layout.pp > 1:
        gaps.append(f"pipeline parallelism (pipeline_parallel={layout.pp})")
    if layout.cp > 1:
        gaps.append(f"context parallelism (context_parallel={layout.cp})")
    if layout.moe is not None or layout.dims.ep > 1:
        gaps.append("the mixture-of-experts model and expert parallelism (--config tiny-moe, expert_parallel)")
    if layout.context.compression is MaskCompression.EOD:
        gaps.append("packed documents (create_compressed_eod_mask)")
    if layout.activation_checkpoint.mode is not ActivationCheckpointMode.NONE:
        gaps.append(f"activation checkpointing ({layout.activation_checkpoint.mode.value})")
    if layout.param_dtype is not FloatDType.FLOAT32 or layout.reduce_dtype is not FloatDType.FLOAT32:
        gaps.append(f"mixed precision (param_dtype {layout.param_dtype.value}, reduce_dtype "
                    f"{layout.reduce_dtype.value})")
    if layout.cpu_offload:
        gaps.append("CPU offload (cpu_offload)")
    if torchrun:
        gaps.append("a torchrun launch (RANK, WORLD_SIZE): launch with msrun, or let the trainer start the ranks")
    return gaps


def check_backend(backend: Backend, layout: TrainLayout, *, checkpoint_format: CheckpointKind | None = None) -> None:
    """``NotImplementedError`` naming every feature of the job the MindSpore backend lacks (use the
    torch backend for them)."""
    if backend is not Backend.MINDSPORE:
        return
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MS_ROLE" not in os.environ
    gaps = mindspore_gaps(layout, checkpoint_format=checkpoint_format, torchrun=torchrun)
    if gaps:
        raise NotImplementedError(f"the MindSpore backend does not support {'; '.join(gaps)} yet: "
                                  f"use --backend torch for it")


def missing_framework(backend: Backend) -> str | None:
    """What to do when this Python lacks ``backend``'s framework (the ranks would fail to import
    it), else None."""
    if backend is Backend.MINDSPORE and importlib.util.find_spec("mindspore") is None:
        return ("--backend mindspore: this Python has no MindSpore; run the command with the Python of a "
                "MindSpore environment (pip install mindspore)")
    return None
