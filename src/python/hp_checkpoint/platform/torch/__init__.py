"""Checkpoints' torch primitives: DCP, safetensors shard files, point-to-point box transfer."""

from hp_checkpoint.platform.torch import agreement as _agreement
from hp_checkpoint.platform.torch import dcp as _dcp
from hp_checkpoint.platform.torch import state_dict as _state_dict
from hp_checkpoint.platform.torch.shard_files import SHARD_FILES
from hp_checkpoint.platform.torch.transfer import TRANSFER


class _TorchDCP:
    """``hp_checkpoint.dcp.DCPPrimitives`` on ``torch.distributed.checkpoint``."""

    save = staticmethod(_dcp.save)
    load = staticmethod(_dcp.load)
    write = staticmethod(_dcp.write)
    tensor_meta = staticmethod(_dcp.tensor_meta)
    get_model_state_dict = staticmethod(_state_dict.get_model_state_dict)
    set_model_state_dict = staticmethod(_state_dict.set_model_state_dict)
    get_optimizer_state_dict = staticmethod(_state_dict.get_optimizer_state_dict)
    set_optimizer_state_dict = staticmethod(_state_dict.set_optimizer_state_dict)
    stage_to_cpu = staticmethod(_state_dict.stage_to_cpu)
    broadcast_object = staticmethod(_agreement.broadcast_object)
    all_gather_object = staticmethod(_agreement.all_gather_object)
    new_world_group = staticmethod(_agreement.new_world_group)


DCP = _TorchDCP()

__all__ = ["DCP", "SHARD_FILES", "TRANSFER"]
