"""Qwen3.5 on MindSpore PyNative: the dense text model as protocol Modules (Cells) built from the
same ``Qwen3_5Config`` as the torch model, with the same parameter names, loading the same HF
checkpoints through the same state-dict adapter and exporting them sharded."""

from hp_models.qwen3_5.mindspore.gated_delta import chunk_gated_delta_rule
from hp_models.qwen3_5.mindspore.model import Qwen3_5ForCausalLM
from hp_models.qwen3_5.mindspore.parallelize import check_tp_size_ms, parallelize_qwen3_5_ms_tp
from hp_models.qwen3_5.mindspore.weights import Qwen3_5MsStateDictAdapter, load_hf_weights, save_hf_weights

__all__ = [
    "Qwen3_5ForCausalLM", "Qwen3_5MsStateDictAdapter", "check_tp_size_ms", "chunk_gated_delta_rule", "load_hf_weights",
    "parallelize_qwen3_5_ms_tp", "save_hf_weights",
]
