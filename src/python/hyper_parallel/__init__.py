"""hyper-parallel: declare how a model is split across devices.

The umbrella package: it re-exports the public API of the hp_* packages (tensor parallelism, FSDP,
expert parallelism, pipeline parallelism, the DTensor layer) and holds no logic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hp_dtensor import (
    CommDebugMode,
    DeviceMesh,
    Partial,
    Placement,
    Replicate,
    Shard,
    init_device_mesh,
    manual_seed,
)
from hp_ep import ExpertParallel
from hp_fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    clip_grad_norm_,
    clip_grads_with_norm_,
    fully_shard,
    get_total_norm,
)
from hp_pp import (
    PipelineAbortedError,
    PipelineConfigError,
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleKind,
    ScheduleZeroBubble,
    StageSplit,
    StepStats,
    build_plan,
    schedule_for,
    split_layers,
)
from hp_tp import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

__version__ = "0.2.0"

if TYPE_CHECKING:
    from hp_dtensor import DTensor, distribute_module, distribute_tensor


def __getattr__(name: str) -> Any:
    if name in ("DTensor", "distribute_tensor", "distribute_module"):
        import hp_dtensor

        return getattr(hp_dtensor, name)
    raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")


__all__ = [
    "ColwiseParallel", "NoParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
    "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "loss_parallel", "parallelize_module",
    "CommDebugMode", "DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard",
    "distribute_module", "distribute_tensor", "init_device_mesh", "manual_seed",
    "CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard",
    "clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm",
    "ExpertParallel",
    "PipelineAbortedError", "PipelineConfigError", "PipelineSchedule", "PipelineStage", "Schedule1F1B",
    "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleKind", "ScheduleZeroBubble", "StageSplit", "StepStats",
    "build_plan", "schedule_for", "split_layers",
]
