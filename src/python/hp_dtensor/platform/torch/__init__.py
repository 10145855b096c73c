"""The torch backend of the platform layer."""

from typing import TYPE_CHECKING

from hp_dtensor.platform.torch import dtensor as _dtensor
from hp_dtensor.platform.torch import kernels as _kernels  # noqa: F401  (the local kernels rules name)
from hp_dtensor.platform.torch.collectives import COLLECTIVES, all_gather_object
from hp_dtensor.platform.torch.dispatch import dispatch as _dispatch
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec, distribute_tensor
from hp_dtensor.platform.torch.modules import (
    FORWARD,
    Module,
    ModuleDict,
    ModuleList,
    Parameter,
    Sequential,
    add_child,
    direct_buffers,
    direct_params,
    init_param_,
    is_embedding_module,
    is_linear_module,
    is_module,
    is_tensor,
    named_children,
    named_modules,
    numel,
    parameters,
    register_buffer,
    register_forward_hook,
    register_forward_pre_hook,
    register_param,
    set_buffer,
    set_param,
    share_param,
    state_dict,
)
from hp_dtensor.platform.torch.process_group import (
    DEVICE_TYPES,
    default_device_type,
    destroy,
    ensure_process_group,
    get_or_create_group,
    get_rank,
    get_world_size,
    init_fake,
    init_rank,
    is_initialized,
    serve_scheduler,
    world_generation,
)
from hp_dtensor.platform.torch.random_ops import RNG

_dtensor.install_dispatch(_dispatch)

NAME = "torch"


def set_num_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


if TYPE_CHECKING:
    # mypy checks this module against the backend contract.
    from hp_dtensor.backend_contract import Backend
    from hp_dtensor.platform import torch as _self

    _conforms: Backend = _self

__all__ = [
    "NAME", "COLLECTIVES", "serve_scheduler", "DTensor", "DTensorSpec", "distribute_tensor", "Module", "ModuleDict", "ModuleList", "Sequential", "init_param_", "numel", "Parameter", "direct_buffers",
    "direct_params", "is_embedding_module", "is_linear_module", "is_module", "is_tensor", "named_children",
    "named_modules", "register_forward_hook", "register_forward_pre_hook", "set_buffer", "set_param", "share_param",
    "destroy", "DEVICE_TYPES", "default_device_type", "ensure_process_group", "get_or_create_group", "get_rank", "world_generation",
    "get_world_size", "init_fake", "init_rank", "is_initialized", "set_num_threads", "RNG",
    "FORWARD", "add_child", "all_gather_object",
    "parameters", "register_buffer", "register_param", "state_dict",
]
