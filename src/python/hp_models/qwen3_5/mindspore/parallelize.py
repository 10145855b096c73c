"""Tensor parallelism of the MindSpore Qwen3.5, declared the hp_protocols way: each Module gets a
``ShardingConfig`` and ``model.parallelize(tp_mesh)`` makes the DTensors, as MindFormers would.

The layouts are those of the torch plan: the embedding is split over the vocab (partial rows
summed), projections into the token mixers and the MLP are column-parallel (whole heads per
rank), output projections row-parallel (partial sums), the linear-attention conv weights and
per-head parameters split by head like the projections feeding them, the q/k norms and the
gated norm applied to this rank's heads (their replicated weights get their gradient summed over
ranks), and ``lm_head`` column-parallel over the vocab.

Without sequence parallelism the activations between blocks are replicated DTensors (each
partial sum is all-reduced).  With it they are ``Shard(1)`` over the sequence: the partial sums
are reduce-scattered, the norms and residual adds run on this rank's tokens, and each token
mixer and MLP gathers its input once (one all-gather per block, not one per projection).  With
loss parallel the logits stay ``Shard(2)`` over the vocab for ``hp_tp.loss_parallel()``'s cross
entropy instead of being gathered.
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


def _rowwise(output: Any) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(1)}},
        in_src_shardings={"input": {TP: Shard(-1)}},
        out_dst_shardings={"output": {TP: output}},
    )


def _gathered_input(config: ShardingConfig | None = None) -> ShardingConfig:
    """A block (token mixer or MLP) that gathers its sequence-sharded input ``x`` once for all
    of its projections; ``config``'s parameter layouts are kept."""
    states = config.state_shardings if config is not None else {}
    return ShardingConfig(state_shardings=states, in_dst_shardings={"x": {TP: Replicate()}})


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


def parallelize_qwen3_5_ms_tp(
    model: Qwen3_5ForCausalLM,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> Qwen3_5ForCausalLM:
    """Declare the plan on every Module of ``model`` and parallelize it over the 1-D ``tp_mesh``
    (in place; returns it).  The model's call then takes ``input_ids`` (the same on every rank)
    and returns the logits as a DTensor: replicated, or ``Shard(2)`` over the vocab with
    ``loss_parallel`` (compute the loss inside ``hp_tp.loss_parallel()``).  ``sequence_parallel``
    keeps the activations between blocks split over the sequence; the numbers are the same."""
    if not isinstance(model, Qwen3_5ForCausalLM):
        raise TypeError(f"parallelize_qwen3_5_ms_tp takes the MindSpore Qwen3_5ForCausalLM, got {type(model).__name__}")
    config: Qwen3_5Config = model.config  # type: ignore[assignment]
    check_tp_size_ms(config, tp_mesh.size())
    # the layout of the residual stream: partial sums of row-parallel outputs are all-reduced to
    # it, or reduce-scattered over the sequence under sequence parallelism
    stream = Shard(1) if sequence_parallel else Replicate()
    body: Any = model.model
    body.embed_tokens.sharding_config = ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}},  # vocab rows: partial sums
        in_dst_shardings={"ids": {TP: Replicate()}},
        out_dst_shardings={"output": {TP: stream}},
    )
    body.norm.sharding_config = _replicated()
    model.lm_head.sharding_config = _colwise(Shard(2) if loss_parallel else Replicate())
    for layer in body.layers:
        layer.input_layernorm.sharding_config = _replicated()
        layer.post_attention_layernorm.sharding_config = _replicated()
        layer.mlp.gate_proj.sharding_config = _colwise()
        layer.mlp.up_proj.sharding_config = _colwise()
        layer.mlp.down_proj.sharding_config = _rowwise(stream)
        if sequence_parallel:
            layer.mlp.sharding_config = _gathered_input()
        mixer = layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn
        if isinstance(mixer, Attention):
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(mixer, name).sharding_config = _colwise()
            mixer.o_proj.sharding_config = _rowwise(stream)
            mixer.q_norm.sharding_config = _per_head("x")
            mixer.k_norm.sharding_config = _per_head("x")
            if sequence_parallel:
                mixer.sharding_config = _gathered_input()
        else:
            assert isinstance(mixer, GatedDeltaNet)
            for name in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a"):
                getattr(mixer, name).sharding_config = _colwise()
            mixer.out_proj.sharding_config = _rowwise(stream)
            heads = ShardingConfig(
                state_shardings={n: {TP: Shard(0)} for n in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")}
            )
            mixer.sharding_config = _gathered_input(heads) if sequence_parallel else heads
            mixer.norm.sharding_config = _per_head("x", "gate")
    tied = config.tie_word_embeddings
    model.parallelize(tp_mesh)
    if tied:
        # Both declarations split the vocab rows (Shard(0)); keep the tie as one DTensor parameter.
        current().share_param(model.lm_head, "weight", body.embed_tokens.weight)
    return model


__all__ = ["check_tp_size_ms", "parallelize_qwen3_5_ms_tp"]
