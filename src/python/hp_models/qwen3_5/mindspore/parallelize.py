"""Tensor parallelism of the MindSpore Qwen3.5, declared the hp_protocols way: each Module gets a
``ShardingConfig`` and ``model.parallelize(tp_mesh)`` makes the DTensors, as MindFormers would.

The layouts are those of the torch plan without sequence parallelism: the embedding is split
over the vocab (partial rows summed to a replicated activation), projections into the token
mixers and the MLP are column-parallel (whole heads per rank), output projections row-parallel
(summed back to replicated), the linear-attention conv weights and per-head parameters split by
head like the projections feeding them, the q/k norms and the gated norm applied to this rank's
heads (their replicated weights get their gradient summed over ranks), and ``lm_head``
column-parallel over the vocab with the logits gathered.  Activations between blocks are
replicated DTensors.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor import DeviceMesh, Replicate, Shard
from hp_dtensor.platform import current
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_models.qwen3_5.mindspore.model import Attention, GatedDeltaNet, Qwen3_5ForCausalLM
from hp_protocols import MeshAxisName, ShardingConfig

TP = MeshAxisName.TP


def _colwise(output: Any = None) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}},
        in_dst_shardings={"input": {TP: Replicate()}},
        out_dst_shardings={} if output is None else {"output": {TP: output}},
    )


def _rowwise() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(1)}},
        in_src_shardings={"input": {TP: Shard(-1)}},
        out_dst_shardings={"output": {TP: Replicate()}},
    )


def _replicated() -> ShardingConfig:
    return ShardingConfig(state_shardings={"weight": {TP: Replicate()}})


def _per_head(*args: str) -> ShardingConfig:
    """A norm over this rank's heads: (B, S, heads, D) arrives as the local heads of ``Shard(2)``."""
    return ShardingConfig(
        state_shardings={"weight": {TP: Replicate()}}, in_src_shardings={a: {TP: Shard(2)} for a in args}
    )


def check_tp_size_ms(config: Qwen3_5Config, tp: int) -> None:
    """``ValueError`` naming every head count and size ``tp`` does not divide."""
    sizes = {
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "linear_num_key_heads": config.linear_num_key_heads, "linear_num_value_heads": config.linear_num_value_heads,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(f"tp={tp} does not divide {bad}; choose a tp that divides every one of them")


def parallelize_qwen3_5_ms_tp(model: Qwen3_5ForCausalLM, tp_mesh: DeviceMesh) -> Qwen3_5ForCausalLM:
    """Declare the plan on every Module of ``model`` and parallelize it over the 1-D ``tp_mesh``
    (in place; returns it).  The model's call then takes ``input_ids`` (the same on every rank)
    and returns replicated logits (a DTensor)."""
    if not isinstance(model, Qwen3_5ForCausalLM):
        raise TypeError(f"parallelize_qwen3_5_ms_tp takes the MindSpore Qwen3_5ForCausalLM, got {type(model).__name__}")
    config: Qwen3_5Config = model.config  # type: ignore[assignment]
    check_tp_size_ms(config, tp_mesh.size())
    body: Any = model.model
    body.embed_tokens.sharding_config = ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}},  # vocab rows: partial sums, then all_reduce
        in_dst_shardings={"ids": {TP: Replicate()}},
        out_dst_shardings={"output": {TP: Replicate()}},
    )
    body.norm.sharding_config = _replicated()
    model.lm_head.sharding_config = _colwise(Replicate())
    for layer in body.layers:
        layer.input_layernorm.sharding_config = _replicated()
        layer.post_attention_layernorm.sharding_config = _replicated()
        layer.mlp.gate_proj.sharding_config = _colwise()
        layer.mlp.up_proj.sharding_config = _colwise()
        layer.mlp.down_proj.sharding_config = _rowwise()
        mixer = layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn
        if isinstance(mixer, Attention):
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(mixer, name).sharding_config = _colwise()
            mixer.o_proj.sharding_config = _rowwise()
            mixer.q_norm.sharding_config = _per_head("x")
            mixer.k_norm.sharding_config = _per_head("x")
        else:
            assert isinstance(mixer, GatedDeltaNet)
            for name in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a"):
                getattr(mixer, name).sharding_config = _colwise()
            mixer.out_proj.sharding_config = _rowwise()
            mixer.sharding_config = ShardingConfig(
                state_shardings={n: {TP: Shard(0)} for n in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")}
            )
            mixer.norm.sharding_config = _per_head("x", "gate")
    tied = config.tie_word_embeddings
    model.parallelize(tp_mesh)
    if tied:
        # Both declarations split the vocab rows (Shard(0)); keep the tie as one DTensor parameter.
        current().share_param(model.lm_head, "weight", body.embed_tokens.weight)
    return model


__all__ = ["check_tp_size_ms", "parallelize_qwen3_5_ms_tp"]
