"""hp_dtensor: DeviceMesh, placements, DTensor and redistribution for hyper-parallel.

Semantics follow ``torch.distributed.tensor``.  The framework is chosen by the platform layer
(``HYPER_PARALLEL_PLATFORM`` or what is installed); pure modules (placements, mesh layout, the
redistribute planner, sharding rules) import no framework.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from hp_dtensor.api.rng_tracker import manual_seed
from hp_dtensor.comm_debug import CommDebugMode
from hp_dtensor.device_mesh import DeviceMesh, get_current_mesh, init_device_mesh
from hp_dtensor.moved_modules import Moved, register_moved
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard

__version__ = "0.2.0"

if TYPE_CHECKING:
    # The backend's DTensor, distribute_tensor and loss_parallel are typed by the backend contract
    # (the core never imports a backend, not even for types): through ``__getattr__`` below.
    from hp_dtensor.api import distribute_module

_LAZY = {"DTensor", "distribute_tensor", "distribute_module", "loss_parallel"}

# Import paths that moved in 0.2.0; the old ones keep working, with a DeprecationWarning, until 0.3.0.
_REMOVED_IN = "hp-dtensor 0.3.0"
register_moved(
    {
        old: Moved(new, dist, _REMOVED_IN)
        for old, new, dist in (
            ("hp_dtensor.mesh_layout", "hp_dtensor.layout.mesh_layout", "hp-dtensor"),
            ("hp_dtensor.shard_geometry", "hp_dtensor.layout.shard_geometry", "hp-dtensor"),
            ("hp_dtensor.dtensor_spec", "hp_dtensor.layout.dtensor_spec", "hp-dtensor"),
            ("hp_dtensor.checkpoint_layout", "hp_dtensor.layout.shard_boxes", "hp-dtensor"),
            ("hp_dtensor.redistribute_planner", "hp_dtensor.redistribute.planner", "hp-dtensor"),
            ("hp_dtensor.redistribute_exec", "hp_dtensor.redistribute.executor", "hp-dtensor"),
            ("hp_dtensor.dispatch_core", "hp_dtensor.sharding.dispatch", "hp-dtensor"),
            ("hp_dtensor.dtensor_methods", "hp_dtensor.api.dtensor_methods", "hp-dtensor"),
            ("hp_dtensor.from_local_check", "hp_dtensor.api.from_local_check", "hp-dtensor"),
            ("hp_dtensor.rng_tracker", "hp_dtensor.api.rng_tracker", "hp-dtensor"),
            ("hp_dtensor.mesh_exchange", "hp_dtensor.api.mesh_exchange", "hp-dtensor"),
            ("hp_dtensor.platform.base", "hp_dtensor.backend_contract", "hp-dtensor"),
            ("hp_dtensor.loss_parallel_kernel", "hp_tp.loss_parallel_kernel", "hp-tp"),
            ("hp_dtensor.loss_parallel_rules", "hp_tp.loss_parallel_rules", "hp-tp"),
            ("hp_dtensor.checkpoint", "hp_checkpoint.dcp", "hp-checkpoint"),
            ("hp_dtensor.checkpoint_atomic", "hp_checkpoint.atomic", "hp-checkpoint"),
            ("hp_dtensor.checkpoint_async", "hp_checkpoint.async_save", "hp-checkpoint"),
            ("hp_dtensor.checkpoint_faults", "hp_checkpoint.faults", "hp-checkpoint"),
            ("hp_dtensor.checkpoint_manifest", "hp_checkpoint.manifest", "hp-checkpoint"),
            ("hp_dtensor.safetensors_shards", "hp_checkpoint.safetensors_shards", "hp-checkpoint"),
            ("hp_dtensor.gather_to_rank", "hp_checkpoint.gather_to_rank", "hp-checkpoint"),
            ("hp_dtensor.export_plan", "hp_checkpoint.export_plan", "hp-checkpoint"),
        )
    }
)


def _moved_attribute(name: str, package: str, distribution: str) -> Any:
    warnings.warn(
        f"hp_dtensor.{name} moved to {package}.{name}; import it from there (removed in {_REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,
    )
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        raise ImportError(f"hp_dtensor.{name} moved to {package}: pip install {distribution}") from exc
    return getattr(module, name)


def __getattr__(name: str) -> Any:
    # DTensor is the selected framework's tensor subclass: resolved on first use so that importing
    # the pure parts never imports a framework.
    if name in ("DTensor", "distribute_tensor"):
        from hp_dtensor.platform import current

        return getattr(current(), name)
    if name == "loss_parallel":
        # Vocab-parallel cross entropy is tensor parallelism's: hp_tp.loss_parallel.
        return _moved_attribute("loss_parallel", "hp_tp", "hp-tp")
    if name == "distribute_module":
        from hp_dtensor.api import distribute_module

        return distribute_module
    raise AttributeError(f"module 'hp_dtensor' has no attribute {name!r}")


__all__ = [
    "CommDebugMode", "DeviceMesh", "DTensor", "Partial", "Placement", "Replicate", "Shard",
    "distribute_module", "distribute_tensor", "get_current_mesh", "init_device_mesh", "manual_seed",
]
