"""hp_protocols: torchtitan-style protocol layer (Configurable, Module, ShardingConfig, ModelSpec,
state-dict adapters) and the parallelism configuration users write."""

from hp_dtensor.moved_modules import Moved, register_moved
from hp_protocols.configurable import Configurable
from hp_protocols.model import BaseModel
from hp_protocols.model_spec import ModelSpec, get_model_spec, register_model_spec
from hp_protocols.module import Module, ModuleDict, ModuleList, Sequential
from hp_protocols.parallelism import (
    DataFacts,
    JobConfig,
    LRDecay,
    ModelFacts,
    ParallelDims,
    ParallelismConfig,
    TrainingConfig,
)
from hp_protocols.sharding import LocalMapConfig, NamedPlacement, ShardingConfig, resolve_placements
from hp_protocols.state_dict_adapter import BaseStateDictAdapter
from hp_protocols.train_features import ActivationCheckpointConfig, ActivationCheckpointMode, FloatDType
from hp_protocols.types import MeshAxisName

__version__ = "0.2.0"

# The HF export moved to the checkpoint package in 0.2.0; the old path warns until 0.3.0.
register_moved({"hp_protocols.hf_export": Moved("hp_checkpoint.hf_export", "hp-checkpoint", "hp-protocols 0.3.0")})

__all__ = [
    "ActivationCheckpointConfig", "ActivationCheckpointMode", "FloatDType",
    "BaseModel", "BaseStateDictAdapter", "Configurable", "DataFacts", "JobConfig", "LocalMapConfig", "LRDecay",
    "MeshAxisName", "ModelFacts", "ModelSpec", "Module", "ModuleDict", "ModuleList", "NamedPlacement",
    "ParallelDims", "ParallelismConfig", "Sequential", "ShardingConfig", "TrainingConfig", "get_model_spec",
    "register_model_spec", "resolve_placements",
]
