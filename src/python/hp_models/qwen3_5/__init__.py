"""Qwen3.5 dense text model, its tensor-parallel, pipeline and context-parallel plans and its HF
checkpoint adapter."""

from hp_models.qwen3_5.config import Qwen3_5Config, reference_config, tiny_config
from hp_models.qwen3_5.context_parallel import (
    cp_cross_entropy,
    gated_delta_net_cp,
    parallelize_qwen3_5_cp,
    sum_cp_gradients,
)
from hp_models.qwen3_5.fsdp import apply_fsdp_qwen3_5
from hp_models.qwen3_5.model import Qwen3_5ForCausalLM
from hp_models.qwen3_5.parallelize import check_tp_size, parallelize_qwen3_5_tp
from hp_models.qwen3_5.pipeline import (
    Qwen3_5Stage,
    parallelize_qwen3_5_stages,
    pipeline_qwen3_5,
    split_qwen3_5,
)
from hp_models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter
from hp_protocols import ModelSpec, register_model_spec

MODEL_SPEC = register_model_spec(
    ModelSpec(
        name="qwen3_5",
        model=tiny_config(),
        parallelize_fn=parallelize_qwen3_5_tp,
        state_dict_adapter=Qwen3_5StateDictAdapter,
    )
)

__all__ = [
    "MODEL_SPEC", "Qwen3_5Config", "Qwen3_5ForCausalLM", "Qwen3_5Stage", "Qwen3_5StateDictAdapter",
    "apply_fsdp_qwen3_5", "check_tp_size", "cp_cross_entropy", "gated_delta_net_cp", "parallelize_qwen3_5_cp",
    "parallelize_qwen3_5_stages", "parallelize_qwen3_5_tp", "pipeline_qwen3_5", "reference_config", "split_qwen3_5",
    "sum_cp_gradients", "tiny_config",
]
