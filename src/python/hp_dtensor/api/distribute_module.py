"""``distribute_module``: turn a module's parameters into DTensors and hook its inputs/outputs.

Framework-neutral: parameters, buffers and hooks are reached through the platform layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_dtensor.device_mesh import DeviceMesh, get_current_mesh
from hp_dtensor.placement_types import Replicate
from hp_dtensor.platform import current as _platform

_APPLIED = "_hp_distribute_module_applied"


def distribute_module(
    module: Any,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, Any, DeviceMesh], None] | None = None,
    input_fn: Callable[[Any, Any, DeviceMesh], Any] | None = None,
    output_fn: Callable[[Any, Any, DeviceMesh], Any] | None = None,
) -> Any:
    """Shard ``module`` once.

    ``partition_fn(name, submodule, mesh)`` runs on every submodule and may replace parameters by
    DTensors; every parameter or buffer it leaves plain becomes a ``Replicate()`` DTensor.
    ``input_fn(module, inputs, mesh)`` runs as a forward pre-hook and ``output_fn(module, outputs,
    mesh)`` as a forward hook on the root.  A second call on the same module raises ``RuntimeError``.
    """
    plat = _platform()
    mesh = device_mesh or get_current_mesh()
    if mesh is None:
        raise ValueError("distribute_module needs a device_mesh (or an active `with mesh:`)")
    if getattr(module, _APPLIED, False):
        raise RuntimeError(
            f"distribute_module was already applied to this {type(module).__name__}; "
            f"a module can be distributed only once"
        )
    setattr(module, _APPLIED, True)
    rep = [Replicate()] * mesh.ndim
    for name, sub in plat.named_modules(module):
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        for pname, param in plat.direct_params(sub):
            if param is not None and not isinstance(param, plat.DTensor):
                plat.set_param(sub, pname, plat.distribute_tensor(param.data, mesh, rep))
        for bname, buf in plat.direct_buffers(sub):
            if buf is not None and not isinstance(buf, plat.DTensor):
                plat.set_buffer(sub, bname, plat.distribute_tensor(buf, mesh, rep))
    if input_fn is not None:
        plat.register_forward_pre_hook(module, lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        plat.register_forward_hook(module, lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    return module
