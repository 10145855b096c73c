"""The dense Qwen3.5 text model on MindSpore PyNative, written as protocol Modules (MindSpore
Cells), the way MindFormers writes models.

Built from the same ``Qwen3_5Config`` as the torch model, with the same module tree and
parameter names (``model.layers.<i>.linear_attn.in_proj_q.weight``, ``...conv_q``, ``lm_head.weight``
...), so the torch model's HF state-dict adapter maps one HF checkpoint onto either framework and
the torch tensor-parallel plan's paths name the same modules.  Layers alternate Gated DeltaNet
linear attention and, every ``full_attention_interval``-th layer, gated full attention (q_proj
also yields a sigmoid output gate; q/k RMS norms; partial rotary).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, ops

from hp_models.qwen3_5.config import Qwen3_5Config
from hp_models.qwen3_5.mindspore.gated_delta import chunk_gated_delta_rule, upcast
from hp_models.qwen3_5.mindspore.layers import (
    Embedding,
    GatedRMSNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    local,
    local_param,
)
from hp_protocols import BaseModel, Module, ModuleList


class Attention(Module):
    """Gated full attention with GQA, q/k RMS norms over head_dim and partial rotary."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        hd, h, bias = config.head_dim, config.hidden_size, config.attention_bias
        self.head_dim = hd
        self.q_proj = Linear(h, config.num_attention_heads * hd * 2, bias)
        self.k_proj = Linear(h, config.num_key_value_heads * hd, bias)
        self.v_proj = Linear(h, config.num_key_value_heads * hd, bias)
        self.o_proj = Linear(config.num_attention_heads * hd, h, bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.n_rep = config.num_attention_heads // config.num_key_value_heads

    def construct(self, x: Any, cos: Any, sin: Any) -> Any:
        b, s = x.shape[0], x.shape[1]
        hd = self.head_dim
        qg = local(self.q_proj(x)).reshape(b, s, -1, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(b, s, -1)
        q = local(self.q_norm(q)).swapaxes(1, 2)
        k = local(self.k_norm(local(self.k_proj(x)).reshape(b, s, -1, hd))).swapaxes(1, 2)
        v = local(self.v_proj(x)).reshape(b, s, -1, hd).swapaxes(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_rep > 1:
            k = ops.repeat_interleave(k, self.n_rep, 1)
            v = ops.repeat_interleave(v, self.n_rep, 1)
        future = Tensor(np.triu(np.ones((s, s), np.bool_), 1))
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * (1.0 / float(np.sqrt(hd)))
        probs = ops.softmax(ops.masked_fill(scores, future, float("-inf")), -1)
        o = ops.matmul(probs, v)
        return self.o_proj(o.swapaxes(1, 2).reshape(b, s, -1) * ops.sigmoid(gate))


class GatedDeltaNet(Module):
    """Linear attention: q/k/v projections, causal depthwise conv + SiLU, the gated delta rule,
    a gated per-head RMSNorm, and the output projection."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.k_head_dim = config.linear_key_head_dim
        self.v_head_dim = config.linear_value_head_dim
        key_dim = config.linear_num_key_heads * self.k_head_dim
        value_dim = config.linear_num_value_heads * self.v_head_dim
        kernel = config.linear_conv_kernel_dim
        heads = config.linear_num_value_heads
        self.chunk_size = config.chunk_size
        self.in_proj_q = Linear(h, key_dim)
        self.in_proj_k = Linear(h, key_dim)
        self.in_proj_v = Linear(h, value_dim)
        self.in_proj_z = Linear(h, value_dim)
        self.in_proj_b = Linear(h, heads)
        self.in_proj_a = Linear(h, heads)
        self.conv_q = Parameter(Tensor(np.zeros((key_dim, kernel), np.float32)), name="conv_q")
        self.conv_k = Parameter(Tensor(np.zeros((key_dim, kernel), np.float32)), name="conv_k")
        self.conv_v = Parameter(Tensor(np.zeros((value_dim, kernel), np.float32)), name="conv_v")
        self.dt_bias = Parameter(Tensor(np.ones((heads,), np.float32)), name="dt_bias")
        self.A_log = Parameter(Tensor(np.zeros((heads,), np.float32)), name="A_log")
        self.norm = GatedRMSNorm(self.v_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(value_dim, h)

    def _init_param(self, name: str, param: Any) -> None:
        if name == "dt_bias":
            param.set_data(ops.ones(param.shape, param.dtype))
        elif name == "A_log":
            param.set_data(ops.log(ops.uniform(param.shape, Tensor(0.01, param.dtype), Tensor(16.0, param.dtype))))
        else:
            super()._init_param(name, param)

    @staticmethod
    def _conv(x: Any, weight: Any) -> Any:
        """Causal depthwise conv over the sequence of (B, S, C), then SiLU: output t reads inputs
        t - kernel + 1 .. t, tap i weighting input t - kernel + 1 + i (torch's conv1d layout)."""
        s, kernel = x.shape[1], weight.shape[-1]
        xp = ops.pad(x, (0, 0, kernel - 1, 0))
        y = xp[:, 0:s] * weight[:, 0]
        for i in range(1, kernel):
            y = y + xp[:, i:i + s] * weight[:, i]
        return ops.silu(y)

    def construct(self, x: Any) -> Any:
        b, s = x.shape[0], x.shape[1]
        q = self._conv(local(self.in_proj_q(x)), local_param(self.conv_q)).reshape(b, s, -1, self.k_head_dim)
        k = self._conv(local(self.in_proj_k(x)), local_param(self.conv_k)).reshape(b, s, -1, self.k_head_dim)
        v = self._conv(local(self.in_proj_v(x)), local_param(self.conv_v)).reshape(b, s, -1, self.v_head_dim)
        z = local(self.in_proj_z(x)).reshape(b, s, -1, self.v_head_dim)
        beta = ops.sigmoid(local(self.in_proj_b(x)))
        decay_rate = ops.exp(upcast(local_param(self.A_log)))
        g = -decay_rate * ops.softplus(upcast(local(self.in_proj_a(x))) + local_param(self.dt_bias))
        o = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size)
        o = local(self.norm(o, z)).reshape(b, s, -1)
        return self.out_proj(o)


class MLP(Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, inter)
        self.up_proj = Linear(h, inter)
        self.down_proj = Linear(inter, h)

    def construct(self, x: Any) -> Any:
        return self.down_proj(ops.silu(local(self.gate_proj(x))) * local(self.up_proj(x)))


class DecoderLayer(Module):
    def __init__(self, config: Qwen3_5Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def construct(self, x: Any, cos: Any, sin: Any) -> Any:
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.layer_type == "linear_attention" else self.self_attn(h, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(Module):
    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = ModuleList([DecoderLayer(config, t) for t in (config.layer_types or [])])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def construct(self, input_ids: Any) -> Any:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(input_ids.shape[1], x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Qwen3_5ForCausalLM(BaseModel):
    """``input_ids`` (B, S) -> logits (B, S, vocab), on MindSpore.  With ``tie_word_embeddings``
    ``lm_head.weight`` is the embedding's ``Parameter`` (one parameter, one gradient)."""

    Config = Qwen3_5Config

    def __init__(self, config: Qwen3_5Config) -> None:
        if not isinstance(config, Qwen3_5Config):
            raise TypeError(f"Qwen3_5ForCausalLM (MindSpore) needs a Qwen3_5Config, got {type(config).__name__}")
        super().__init__(config)
        self.model = TextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def construct(self, input_ids: Any) -> Any:
        return self.lm_head(self.model(input_ids))


__all__ = ["Qwen3_5ForCausalLM"]
