"""hp_dtensor: DeviceMesh, placements, DTensor and redistribution for hyper-parallel.

Semantics follow ``torch.distributed.tensor``.  The framework is chosen by the platform layer
(``HYPER_PARALLEL_PLATFORM`` or what is installed); pure modules (placements, mesh layout, the
redistribute planner, sharding rules) import no framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hp_dtensor.comm_debug import CommDebugMode
from hp_dtensor.device_mesh import DeviceMesh, get_current_mesh, init_device_mesh
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.rng_tracker import manual_seed

__version__ = "0.1.0"

if TYPE_CHECKING:
    # The backend's DTensor, distribute_tensor and loss_parallel are typed by the backend contract
    # (the core never imports a backend, not even for types): through ``__getattr__`` below.
    from hp_dtensor.api import distribute_module

_LAZY = {"DTensor", "distribute_tensor", "distribute_module", "loss_parallel"}


def __getattr__(name: str) -> Any:
    # DTensor is the selected framework's tensor subclass: resolved on first use so that importing
    # the pure parts never imports a framework.
    if name in ("DTensor", "distribute_tensor"):
        from hp_dtensor.platform import current

        return getattr(current(), name)
    if name == "loss_parallel":
        # Vocab-parallel cross entropy (a context manager): reachable without hp_tp, for
        # consumers of hp_protocols that shard by declaration.
        from hp_dtensor.platform import current

        return current().loss_parallel
    if name == "distribute_module":
        from hp_dtensor.api import distribute_module

        return distribute_module
    raise AttributeError(f"module 'hp_dtensor' has no attribute {name!r}")


__all__ = [
    "CommDebugMode", "DeviceMesh", "DTensor", "Partial", "Placement", "Replicate", "Shard",
    "distribute_module", "distribute_tensor", "get_current_mesh", "init_device_mesh", "manual_seed",
    "loss_parallel",
]
