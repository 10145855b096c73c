"""The plan walker bound to torch's collectives (the DTensor's autograd adapters are in ``dtensor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hp_dtensor.placement_types import Placement
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.redistribute import executor as redistribute_exec
from hp_dtensor.redistribute.executor import grad_placements as grad_placements  # re-exported

if TYPE_CHECKING:
    from hp_dtensor.device_mesh import DeviceMesh


def redistribute_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    global_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
) -> torch.Tensor:
    """Apply the cheapest plan from ``src`` to ``dst`` to this rank's ``local`` shard."""
    return redistribute_exec.redistribute_local(local, mesh, global_shape, src, dst, C.COLLECTIVES)  # type: ignore[no-any-return]
