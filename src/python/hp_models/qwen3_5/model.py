"""The dense Qwen3.5 text model (HF ``qwen3_5_text`` semantics), written as protocol Modules.

Layers alternate Gated DeltaNet linear attention and, every ``full_attention_interval``-th layer,
gated full attention (q_proj also yields a sigmoid output gate; q/k RMS norms; partial rotary).
Differences from the HF layout, for tensor parallelism by heads: the fused ``in_proj_qkv`` and
its depthwise conv are held as separate q/k/v projections and conv weights (the state-dict
adapter fuses and splits them).  Everything runs on local tensors inside the token mixers, so a
rank holding some heads computes exactly those heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DTensor, Partial
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_models.qwen3_5.gated_delta import chunk_gated_delta_rule, upcast
from hp_protocols import BaseModel, Module


def local(t: Any, *, partial_grad: bool = False) -> torch.Tensor:
    """The rank's local values of a parameter.  A replicated parameter used on rank-local heads
    gets a Partial gradient (each rank contributes its heads' share)."""
    if isinstance(t, DTensor):
        if partial_grad and all(p.is_replicate() for p in t.placements):
            return t.to_local(grad_placements=[Partial()] * t.device_mesh.ndim)
        return t.to_local()
    return t


def decoder_layers(body: nn.Module) -> list[nn.Module]:
    """The decoder layers of a text model in order, also of a pipeline stage's body, which keeps
    its layers under their index in the whole model (a ``ModuleDict``)."""
    layers: Any = body.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


class RMSNorm(Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + weight)``, computed in fp32."""

    hp_tokenwise = True  # per token, no randomness: SequenceParallel runs it on the local shard

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _init_param(self, name: str, param: Any) -> None:
        with torch.no_grad():
            param.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + upcast(self.weight))).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times ``silu(gate)`` (weight initialized to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = local(self.weight, partial_grad=True) * xf.to(dtype)
        return (out * F.silu(upcast(gate))).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of (B, H, S, D); the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        dim = config.rotary_dim
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        pos = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None, None]  # (1, 1, S, rotary_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def at(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, 1, S, rotary_dim) at explicit positions (B, S): a sequence split over
        ranks, or packed documents whose positions restart at each document."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(Module):
    """Gated full attention with GQA, q/k RMS norms over head_dim and partial rotary."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * hd * 2, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.n_rep = config.num_attention_heads // config.num_key_value_heads

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, S, D), k and v (B, Hkv, S, D) with q/k normed and rotated, and the output
        gate (B, S, H * D): everything before the attention kernel."""
        b, s = x.shape[0], x.shape[1]
        hd = self.head_dim
        q, gate = self.q_proj(x).view(b, s, -1, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(b, s, -1)
        q = local(self.q_norm(q)).transpose(1, 2)
        k = local(self.k_norm(self.k_proj(x).view(b, s, -1, hd))).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The attention kernel's output (B, H, S, D), gated and projected back."""
        b, s = o.shape[0], o.shape[2]
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = self.project(x, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        return self.finish(F.scaled_dot_product_attention(q, k, v, is_causal=True), gate)


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
        self.chunk_size = config.chunk_size
        self.in_proj_q = nn.Linear(h, key_dim, bias=False)
        self.in_proj_k = nn.Linear(h, key_dim, bias=False)
        self.in_proj_v = nn.Linear(h, value_dim, bias=False)
        self.in_proj_z = nn.Linear(h, value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, config.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(h, config.linear_num_value_heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(key_dim, kernel))
        self.conv_k = nn.Parameter(torch.empty(key_dim, kernel))
        self.conv_v = nn.Parameter(torch.empty(value_dim, kernel))
        self.dt_bias = nn.Parameter(torch.ones(config.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.empty(config.linear_num_value_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.v_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, h, bias=False)
        nn.init.normal_(self.conv_q, std=0.02)
        nn.init.normal_(self.conv_k, std=0.02)
        nn.init.normal_(self.conv_v, std=0.02)

    def _init_param(self, name: str, param: Any) -> None:
        with torch.no_grad():
            if name == "dt_bias":
                param.fill_(1.0)
            elif name == "A_log":
                param.copy_(torch.empty_like(param).uniform_(0.01, 16).log())
            else:
                super()._init_param(name, param)

    @staticmethod
    def _conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv over the sequence of (B, S, C), then SiLU."""
        w = local(weight)
        s = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=w.shape[-1] - 1, groups=w.shape[0])
        return F.silu(y[:, :, :s]).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self._conv(self.in_proj_q(x), self.conv_q).reshape(b, s, -1, self.k_head_dim)
        k = self._conv(self.in_proj_k(x), self.conv_k).reshape(b, s, -1, self.k_head_dim)
        v = self._conv(self.in_proj_v(x), self.conv_v).reshape(b, s, -1, self.v_head_dim)
        z = self.in_proj_z(x).reshape(b, s, -1, self.v_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -upcast(local(self.A_log)).exp() * F.softplus(upcast(self.in_proj_a(x)) + local(self.dt_bias))
        o = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size)
        o = self.norm(o, z).reshape(b, s, -1)
        return self.out_proj(o)


class MLP(Module):
    def __init__(self, config: Qwen3_5Config, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(Module):
    def __init__(self, config: Qwen3_5Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        self.mlp = self._make_mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _make_mlp(self, config: Qwen3_5Config) -> Module:
        """The feed-forward block; a sparse-MoE variant overrides this."""
        return MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h)
        else:
            h = self.self_attn(h, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(Module):
    layer_cls: type[DecoderLayer] = DecoderLayer  # a sparse-MoE variant swaps the decoder layer

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(self.layer_cls(config, t) for t in (config.layer_types or []))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(input_ids.shape[1], x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Qwen3_5ForCausalLM(BaseModel):
    """``input_ids`` (B, S) -> logits (B, S, vocab)."""

    Config = Qwen3_5Config

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__(config)
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, int]:
        cfg: Qwen3_5Config = self.config  # type: ignore[assignment]
        nparams, flops = super().get_nparams_and_flops(seq_len)
        n_full = sum(t == "full_attention" for t in (cfg.layer_types or []))
        # attention scores and values: 2 matmuls x (fwd + 2 bwd) x heads x head_dim x seq
        flops += 12 * n_full * cfg.num_attention_heads * cfg.head_dim * seq_len
        return nparams, flops


__all__ = ["Qwen3_5ForCausalLM"]
