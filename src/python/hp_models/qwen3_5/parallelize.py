"""The tensor-parallel plan of Qwen3.5 (the styles are described in docs/tensor-parallel.md).

With sequence parallelism, activations between blocks are DTensors sharded on the sequence
(``Shard(1)``): norms run on their shard, each token mixer and MLP gathers the sequence at entry
(``PrepareModuleInput``), projections are column-parallel by head, and the row-parallel output
projections reduce-scatter straight back to ``Shard(1)``.  Linear-attention layers are split by
head too: their conv weights and per-head parameters are sharded like the projections, so no
head is ever gathered.  ``lm_head`` keeps the vocab sharded for loss parallel.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor import DeviceMesh, Placement, Replicate, Shard
from hp_dtensor.platform import current as _platform
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_models.qwen3_5.model import decoder_layers
from hp_tp import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def check_tp_size(config: Qwen3_5Config, tp: int) -> None:
    """Raise ``ValueError`` naming every size that ``tp`` does not divide."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tp={tp} does not divide {detail}; pick a tp that divides all of them")


MlpPlan = Callable[[Placement], dict[str, ParallelStyle]]


def dense_mlp_plan(seq: Placement) -> dict[str, ParallelStyle]:
    """The dense MLP's styles (keys relative to the decoder layer): the sequence gathered at
    entry, gate/up column-parallel, down row-parallel back to ``seq``."""
    return {
        "mlp": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate()),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
    }


def parallelize_qwen3_5_tp(
    model: Any, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True, loss_parallel: bool = True,
    context_parallel: int = 1,
    mlp_plan: MlpPlan = dense_mlp_plan,
) -> Any:
    """Apply the plan in place on a 1-D ``tp_mesh``; returns the model.

    The model's forward then takes ``input_ids`` replicated on every rank and returns logits as a
    DTensor: ``Shard(-1)`` over the vocab when ``loss_parallel`` (use ``hp_tp.loss_parallel()``
    for the loss), else ``Replicate()``.  With ``context_parallel > 1`` the sequence is already
    split over the CP ranks, so sequence parallelism is ignored with a warning.  ``mlp_plan``
    gives each layer's MLP styles from the activation layout between blocks (a model whose MLP is
    not the dense one passes its own)."""
    config: Qwen3_5Config = model.config
    tp = tp_mesh.size()
    check_tp_size(config, tp)
    if context_parallel > 1 and sequence_parallel:
        warnings.warn(
            f"sequence parallel conflicts with context parallel (context_parallel={context_parallel} > 1): "
            f"sequence_parallel is ignored, activations stay replicated over the tp ranks",
            UserWarning, stacklevel=2,
        )
        sequence_parallel = False
    seq = Shard(1) if sequence_parallel else Replicate()

    def norm() -> ParallelStyle:
        if sequence_parallel:
            return SequenceParallel()
        return NoParallel(use_local_output=False)

    top: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "model.norm": norm(),
        "lm_head": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=False,
        ),
    }
    # A pipeline stage (``Qwen3_5Stage``) holds only some of the embedding, final norm and head.
    body, head = model.model, getattr(model, "lm_head", None)
    present = {"model.embed_tokens": hasattr(body, "embed_tokens"), "model.norm": hasattr(body, "norm"),
               "lm_head": head is not None}
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if present[k]})
    if (config.tie_word_embeddings and head is not None and hasattr(body, "embed_tokens")
            and head.weight is not body.embed_tokens.weight):
        # Both styles split the vocab rows (Shard(0)), so the tie is kept as one DTensor parameter;
        # a model whose tie was already broken before this call is refused rather than trained apart.
        raise ValueError(
            "tie_word_embeddings=True but lm_head.weight is not model.embed_tokens.weight after "
            "parallelize_qwen3_5_tp; re-tie them (model.lm_head.weight = model.model.embed_tokens.weight) "
            "before parallelizing"
        )
    for layer in decoder_layers(body):
        plan: dict[str, ParallelStyle] = {
            "input_layernorm": norm(),
            "post_attention_layernorm": norm(),
            **mlp_plan(seq),
        }
        if layer.layer_type == "full_attention":
            plan.update({
                "self_attn": PrepareModuleInput(
                    input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "self_attn.o_proj": RowwiseParallel(
                    output_layouts=seq, use_local_output=False, reduce_dtype=_reduce_dtype(model)
                ),
            })
        else:
            plan.update({
                "linear_attn": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate()),
                "linear_attn.in_proj_q": ColwiseParallel(),
                "linear_attn.in_proj_k": ColwiseParallel(),
                "linear_attn.in_proj_v": ColwiseParallel(),
                "linear_attn.in_proj_z": ColwiseParallel(),
                "linear_attn.in_proj_b": ColwiseParallel(),
                "linear_attn.in_proj_a": ColwiseParallel(),
                "linear_attn.out_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
            })
        parallelize_module(layer, tp_mesh, plan)
        if layer.layer_type == "linear_attention":
            _shard_linear_attention_by_head(layer.linear_attn, tp_mesh)
    return model


def _reduce_dtype(model: Any) -> Any:
    # Low-precision models sum the attention output over ranks in fp32 to limit rounding; fp32 needs nothing.
    dtype = next(model.parameters()).dtype
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else None


def _shard_linear_attention_by_head(mixer: Any, tp_mesh: DeviceMesh) -> None:
    """Conv weights and per-head parameters split by head like the projections feeding them
    (channels are head-major, so ``Shard(0)`` gives each rank whole heads); the gated norm, which
    acts within a head, replicated."""
    plat = _platform()
    for name in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log"):
        param = getattr(mixer, name)
        plat.set_param(mixer, name, plat.distribute_tensor(param.data, tp_mesh, [Shard(0)]))
    norm = mixer.norm
    plat.set_param(norm, "weight", plat.distribute_tensor(norm.weight.data, tp_mesh, [Replicate()]))
