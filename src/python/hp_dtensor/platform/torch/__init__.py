"""The torch backend of the platform layer."""

from typing import TYPE_CHECKING

from hp_dtensor.platform.torch import dtensor as _dtensor
from hp_dtensor.platform.torch import local_layers
from hp_dtensor.platform.torch import ops as _ops  # noqa: F401  (registers the sharding rules)
from hp_dtensor.platform.torch.checkpoint import load_safetensors, save_safetensors
from hp_dtensor.platform.torch.checkpoint_state import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    stage_to_cpu,
)
from hp_dtensor.platform.torch.collectives import COLLECTIVES, all_gather_object, broadcast_object
from hp_dtensor.platform.torch.dcp import load as dcp_load
from hp_dtensor.platform.torch.dcp import save as dcp_save
from hp_dtensor.platform.torch.dcp import tensor_meta
from hp_dtensor.platform.torch.dcp import write as dcp_write
from hp_dtensor.platform.torch.dispatch import dispatch as _dispatch
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec, distribute_tensor
from hp_dtensor.platform.torch.fsdp import FSDP
from hp_dtensor.platform.torch.grad_norm import GRAD_NORM
from hp_dtensor.platform.torch.loss_parallel import loss_parallel
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
    track_module_forward,
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
    new_world_group,
    serve_scheduler,
)
from hp_dtensor.platform.torch.random_ops import RNG
from hp_dtensor.platform.torch.shard_files import SHARD_FILES
from hp_dtensor.platform.torch.transfer import TRANSFER

_dtensor.install_dispatch(_dispatch)

NAME = "torch"


def set_num_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


if TYPE_CHECKING:
    # mypy checks this module against the backend contract.
    from hp_dtensor.platform import torch as _self
    from hp_dtensor.platform.base import Backend

    _conforms: Backend = _self

__all__ = [
    "NAME", "COLLECTIVES", "serve_scheduler", "FSDP", "GRAD_NORM", "local_layers", "load_safetensors", "save_safetensors", "loss_parallel", "DTensor", "DTensorSpec", "distribute_tensor", "Module", "ModuleDict", "ModuleList", "Sequential", "init_param_", "numel", "Parameter", "direct_buffers",
    "direct_params", "is_embedding_module", "is_linear_module", "is_module", "is_tensor", "named_children",
    "named_modules", "register_forward_hook", "register_forward_pre_hook", "set_buffer", "set_param", "share_param",
    "track_module_forward", "DEVICE_TYPES", "default_device_type", "destroy", "ensure_process_group", "get_or_create_group", "get_rank",
    "get_world_size", "init_fake", "init_rank", "is_initialized", "set_num_threads", "RNG", "SHARD_FILES", "TRANSFER",
    "FORWARD", "add_child", "all_gather_object", "broadcast_object", "dcp_load", "dcp_save", "dcp_write",
    "tensor_meta", "stage_to_cpu", "new_world_group", "get_model_state_dict", "get_optimizer_state_dict",
    "set_model_state_dict", "set_optimizer_state_dict", "parameters", "register_buffer", "register_param", "state_dict",
]
