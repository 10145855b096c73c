"""hp_pp: pipeline parallelism for hyper-parallel.

A model is cut by layer into virtual stages (``split_layers``: ``auto`` or explicit ranges per
stage); each rank wraps its chunk(s) in a ``PipelineStage`` and steps a schedule
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZeroBubble``) with the
API of ``torch.distributed.pipelining``.  Every schedule is a pure plan of per-rank actions
(``build_plan``; print it, ``simulate`` it) that the runner executes with P2P on the ``pp`` mesh dim.
"""

from hp_pp.actions import Action, ActionKind
from hp_pp.errors import PipelineAbortedError, PipelineConfigError
from hp_pp.runner import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    StepStats,
)
from hp_pp.schedules import PipelinePlan, ScheduleKind, Simulation, build_plan, simulate, theoretical_bubble
from hp_pp.split import StageSplit, split_layers, stage_rank
from hp_pp.stage import PipelineStage

__version__ = "0.1.0"

__all__ = [
    "Action", "ActionKind", "PipelineAbortedError", "PipelineConfigError", "PipelinePlan", "PipelineSchedule",
    "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleKind",
    "ScheduleZeroBubble", "Simulation", "StageSplit", "StepStats", "build_plan", "schedule_for", "simulate",
    "split_layers", "stage_rank", "theoretical_bubble",
]


def schedule_for(kind: ScheduleKind) -> type[PipelineSchedule]:
    """The schedule class of ``kind``."""
    return {
        ScheduleKind.GPIPE: ScheduleGPipe, ScheduleKind.ONE_F_ONE_B: Schedule1F1B,
        ScheduleKind.INTERLEAVED_1F1B: ScheduleInterleaved1F1B, ScheduleKind.ZERO_BUBBLE: ScheduleZeroBubble,
    }[kind]
