"""``Qwen3_5MoeConfig``: the sparse-MoE Qwen3.5 text model's hyper-parameters (HF ``qwen3_5_moe_text``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hp_models.qwen3_5.config import _HF_KEYS, Qwen3_5Config

_MOE_KEYS = {
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
    "router_aux_loss_coef",
}


@dataclasses.dataclass(kw_only=True, slots=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """The dense model's hybrid layers with every MLP a sparse MoE block: a softmax router picking
    ``num_experts_per_tok`` of ``num_experts`` experts per token (weights renormalised over the
    chosen ones when ``norm_topk_prob``), plus a shared expert scaled by a sigmoid gate.  The
    router's load-balancing loss is added with ``router_aux_loss_coef``."""

    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        Qwen3_5Config.__post_init__(self)  # slotted dataclasses cannot use zero-argument super()
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok (top_k) {self.num_experts_per_tok} must be between 1 and num_experts "
                f"{self.num_experts}; lower top_k or add experts"
            )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> Qwen3_5MoeConfig:
        """From a HF ``config.json`` (``qwen3_5_moe_text``, or ``qwen3_5_moe`` holding it in ``text_config``)."""
        if "text_config" in raw:
            raw = raw["text_config"]
        dense = Qwen3_5Config.from_hf_dict(raw)
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(Qwen3_5Config)}
        fields.update({k: v for k, v in raw.items() if k in _MOE_KEYS})
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``qwen3_5_moe_text`` config.json fields for this config."""
        out: dict[str, Any] = {k: getattr(self, k) for k in sorted(_HF_KEYS - {"intermediate_size"})}
        out.update({k: getattr(self, k) for k in sorted(_MOE_KEYS)})
        out["model_type"] = "qwen3_5_moe_text"
        out["rope_parameters"] = {
            "rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor,
        }
        return out


def tiny_moe_config(**overrides: Any) -> Qwen3_5MoeConfig:
    """Four layers (three Gated DeltaNet, one full attention), 8 experts, top-2: trains on a CPU;
    experts divisible by ep in {1, 2, 4, 8}, heads by tp in {1, 2, 4}."""
    base: dict[str, Any] = dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=4, linear_num_value_heads=8, max_position_embeddings=2048, chunk_size=32,
        moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
    )
    base.update(overrides)
    return Qwen3_5MoeConfig(**base)
