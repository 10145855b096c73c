"""``PipelineStage``: one model chunk, the virtual stage it is, and where its neighbours run.

As in ``torch.distributed.pipelining``: a stage wraps the module that runs virtual stage
``stage_index`` of ``num_stages``; the first takes the step's inputs, the last returns what the
loss function reads.  Virtual stage ``v`` must run on pp rank ``v % pp`` (the ``pp`` dim of
``mesh``, or the mesh itself when it is 1-D), which the constructor checks.  Parameters shared
with another stage (tied input and output embeddings) are named in ``tied_parameters``: after a
step's last backward their gradients are summed over the stages that hold them, so the copies
stay equal under the same optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_dtensor import DeviceMesh
from hp_pp.errors import PipelineConfigError
from hp_pp.split import stage_rank


class PipelineStage:
    def __init__(
        self,
        module: Any,
        stage_index: int,
        num_stages: int,
        mesh: DeviceMesh,
        *,
        pp_dim: str = "pp",
        tied_parameters: Mapping[str, Any] | None = None,
        check_finite: bool = False,
    ) -> None:
        """``check_finite``: raise ``FloatingPointError`` (on every rank, through the schedule) as
        soon as a forward output holds a NaN or an infinity, naming the stage and microbatch."""
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a hp_dtensor DeviceMesh, got {type(mesh).__name__}")
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise PipelineConfigError(
                f"stage_index {stage_index} is not a stage of num_stages={num_stages}; use 0..{num_stages - 1}"
            )
        if mesh.ndim == 1:
            dim = 0
        else:
            names = mesh.mesh_dim_names or ()
            if pp_dim not in names:
                raise PipelineConfigError(
                    f"the mesh has dims {names} and no {pp_dim!r} dim; pass the mesh with a pp dim or a 1-D pp mesh"
                )
            dim = names.index(pp_dim)
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.mesh = mesh
        self.pp_size = mesh.size(dim)
        self.pp_rank = mesh.get_local_rank(dim)
        self.pp_group = mesh.get_group(dim)
        self.pp_ranks = mesh.group_ranks(dim)  # global ranks, by pp rank
        self.tied_parameters = dict(tied_parameters or {})
        self.check_finite = check_finite
        if num_stages % self.pp_size:
            raise PipelineConfigError(
                f"num_stages={num_stages} is not a multiple of the pp size {self.pp_size}: each pp rank runs the "
                f"same number of stages"
            )
        want = stage_rank(stage_index, self.pp_size)
        if want != self.pp_rank:
            raise PipelineConfigError(
                f"stage {stage_index} of {num_stages} runs on pp rank {want} (stage % pp, pp={self.pp_size}) but "
                f"this rank is pp rank {self.pp_rank}; build stage {self.pp_rank + self.pp_size * 0}, "
                f"{self.pp_rank + self.pp_size}, ... here"
            )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages} on pp rank {self.pp_rank})"
