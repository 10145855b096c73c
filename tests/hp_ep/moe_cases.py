"""What the expert-parallel tests share: the small Qwen3.5-MoE they shard, a seeded reference
model and MoE block to compare against, and reading a parameter whether or not it is a DTensor."""

from __future__ import annotations

import random
from typing import Any

import torch


def tiny_model_config(**overrides: Any) -> Any:
    """A 4-layer Qwen3.5-MoE small enough for 4 gloo ranks on 2 cores (8 experts, top-2 unless
    ``overrides`` say otherwise)."""
    from hp_models.qwen3_5_moe import tiny_moe_config

    sizes = {"vocab_size": 64, "hidden_size": 32, "head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
             "intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
             "chunk_size": 8, "router_aux_loss_coef": 0.1}
    return tiny_moe_config(**{**sizes, **overrides})


def perturbed_model(cfg: Any, seed: int) -> Any:
    """The model of ``cfg`` with seeded weights moved off their initial values (zero-initialised
    gates and norms would hide a wrong gradient)."""
    from hp_models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def seeded_block(cfg: Any, seed: int, case: random.Random, skew: bool) -> Any:
    """A ``SparseMoeBlock`` with seeded weights; ``skew``: every token's largest router logit is
    one expert's (drawn from ``case``), so that expert gets all the traffic."""
    from hp_models.qwen3_5_moe import SparseMoeBlock

    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        if skew:
            block.gate.weight.zero_()
            block.gate.weight[case.randrange(cfg.num_experts)] = 5.0
    return block


def local_of(t: Any) -> Any:
    """This rank's values of a DTensor, or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def full_of(t: Any) -> Any:
    """The whole value of a DTensor, or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
