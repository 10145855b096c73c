"""``Qwen3_5Config``: the dense Qwen3.5 text model's hyper-parameters (HF ``qwen3_5_text``)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hp_protocols import BaseModel

_HF_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "layer_types", "pad_token_id", "max_position_embeddings",
}


@dataclasses.dataclass(kw_only=True, slots=True)
class Qwen3_5Config(BaseModel.Config):
    """Hybrid decoder: Gated DeltaNet (linear attention) layers, and every
    ``full_attention_interval``-th layer gated full attention with partial rotary."""

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    chunk_size: int = 64  # chunk length of the linear-attention recurrence

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "linear_attention"})
        if bad:
            raise ValueError(f"unknown layer types {bad}; use full_attention or linear_attention")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} must be a multiple of linear_num_key_heads "
                f"{self.linear_num_key_heads}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> Qwen3_5Config:
        """From a HF ``config.json`` (a ``qwen3_5_text`` config, or a ``qwen3_5`` one holding it in
        ``text_config``); keys that do not shape the text model are ignored."""
        if "text_config" in raw:
            raw = raw["text_config"]
        kwargs = {k: v for k, v in raw.items() if k in _HF_KEYS}
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        elif "rope_theta" in raw:
            kwargs["rope_theta"] = float(raw["rope_theta"])
        if "partial_rotary_factor" in rope:
            kwargs["partial_rotary_factor"] = float(rope["partial_rotary_factor"])
        if "full_attention_interval" in raw and "layer_types" not in raw:
            kwargs["full_attention_interval"] = int(raw["full_attention_interval"])
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: str) -> Qwen3_5Config:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist; pass 'tiny' or a HF config.json path")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``qwen3_5_text`` config.json fields for this config."""
        out: dict[str, Any] = {k: getattr(self, k) for k in sorted(_HF_KEYS)}
        out["model_type"] = "qwen3_5_text"
        out["rope_parameters"] = {
            "rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor,
        }
        return out


def tiny_config(**overrides: Any) -> Qwen3_5Config:
    """A few million parameters: trains on a CPU, divisible for tp in {1, 2, 4}."""
    base: dict[str, Any] = dict(
        vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, max_position_embeddings=2048, chunk_size=32,
    )
    base.update(overrides)
    return Qwen3_5Config(**base)


def reference_config() -> Qwen3_5Config:
    """The full-size defaults of ``transformers``' ``Qwen3_5TextConfig`` (its "Qwen3.5-9B style"
    configuration), for reference: not trainable on a CPU."""
    return Qwen3_5Config()
