"""Qwen3.5 sparse-MoE text model (HF ``qwen3_5_moe_text``) and its HF checkpoint adapter."""

from hp_models.qwen3_5_moe.config import Qwen3_5MoeConfig, tiny_moe_config
from hp_models.qwen3_5_moe.model import (
    GroupedExperts,
    Qwen3_5MoeForCausalLM,
    SparseMoeBlock,
    load_balancing_loss,
)
from hp_models.qwen3_5_moe.state_dict_adapter import Qwen3_5MoeStateDictAdapter
from hp_protocols import ModelSpec, register_model_spec

MODEL_SPEC = register_model_spec(
    ModelSpec(
        name="qwen3_5_moe",
        model=tiny_moe_config(),
        state_dict_adapter=Qwen3_5MoeStateDictAdapter,
    )
)

__all__ = [
    "MODEL_SPEC", "GroupedExperts", "Qwen3_5MoeConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeStateDictAdapter",
    "SparseMoeBlock", "load_balancing_loss", "tiny_moe_config",
]
