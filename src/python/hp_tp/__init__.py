"""hp_tp: declarative tensor parallelism (seven ParallelStyles and parallelize_module)."""

from hp_tp.api import parallelize_module
from hp_tp.loss import loss_parallel
from hp_tp.style import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__version__ = "0.1.1"

__all__ = [
    "ColwiseParallel", "NoParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
    "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "loss_parallel", "parallelize_module",
]
