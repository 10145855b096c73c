# mypy: disable-error-code="no-untyped-def,import-not-found,import-untyped,attr-defined,arg-type,call-overload"
"""The consumer test's decoder on torch: the same hp_protocols Modules and ShardingConfigs as
``ms_decoder.py``, written with torch ops, for the cross-framework parity run."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from ms_decoder import colwise, replicated, rowwise
from torch import nn

from hp_dtensor import Replicate, Shard
from hp_protocols import BaseModel, MeshAxisName, Module, ShardingConfig

TP = MeshAxisName.TP


class Linear(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        din: int
        dout: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.zeros(config.dout, config.din))

    def forward(self, input: Any) -> Any:
        return F.linear(input, self.weight)


class Embedding(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        vocab: int
        dim: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.zeros(config.vocab, config.dim))

    def forward(self, ids: Any) -> Any:
        return F.embedding(ids, self.weight)


class RMSNorm(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-6

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.ones(config.dim))

    def forward(self, x: Any) -> Any:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.config.eps) * self.weight


class Attention(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        heads: int
        seq: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        d = config.dim
        self.q_proj = Linear.Config(din=d, dout=d, sharding_config=colwise()).build()
        self.k_proj = Linear.Config(din=d, dout=d, sharding_config=colwise()).build()
        self.v_proj = Linear.Config(din=d, dout=d, sharding_config=colwise()).build()
        self.o_proj = Linear.Config(din=d, dout=d, sharding_config=rowwise()).build()
        self.register_buffer("mask", torch.full((config.seq, config.seq), -1e9).triu(1))

    def forward(self, x: Any) -> Any:
        b, s, d = x.shape
        heads = self.config.heads
        dh = d // heads

        def split(t: Any) -> Any:
            return t.reshape(b, s, heads, dh).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(dh)) + self.mask
        ctx = torch.matmul(torch.softmax(scores, -1), v)
        return self.o_proj(ctx.transpose(1, 2).reshape(b, s, d))


class SwiGLU(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        ffn: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gate = Linear.Config(din=config.dim, dout=config.ffn, sharding_config=colwise()).build()
        self.up = Linear.Config(din=config.dim, dout=config.ffn, sharding_config=colwise()).build()
        self.down = Linear.Config(din=config.ffn, dout=config.dim, sharding_config=rowwise()).build()

    def forward(self, x: Any) -> Any:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TinyDecoder(BaseModel):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        vocab: int
        dim: int
        heads: int
        ffn: int
        seq: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        c = config
        self.embed = Embedding.Config(vocab=c.vocab, dim=c.dim, sharding_config=ShardingConfig(
            state_shardings={"weight": {TP: Shard(0)}},
            in_dst_shardings={"ids": {TP: Replicate()}},
            out_dst_shardings={"output": {TP: Replicate()}},
        )).build()
        self.attn_norm = RMSNorm.Config(dim=c.dim, sharding_config=replicated("weight")).build()
        self.attn = Attention.Config(dim=c.dim, heads=c.heads, seq=c.seq,
                                     sharding_config=replicated("mask")).build()
        self.mlp_norm = RMSNorm.Config(dim=c.dim, sharding_config=replicated("weight")).build()
        self.mlp = SwiGLU.Config(dim=c.dim, ffn=c.ffn).build()
        self.norm = RMSNorm.Config(dim=c.dim, sharding_config=replicated("weight")).build()
        self.lm_head = Linear.Config(din=c.dim, dout=c.vocab, sharding_config=colwise()).build()

    def forward(self, ids: Any) -> Any:
        h = self.embed(ids)
        h = h + self.attn(self.attn_norm(h))
        h = h + self.mlp(self.mlp_norm(h))
        return self.lm_head(self.norm(h))
