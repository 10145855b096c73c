# mypy: disable-error-code="no-untyped-def,import-not-found,import-untyped,attr-defined,arg-type,call-overload"
"""A MindFormers-shaped decoder block written as hp_protocols Modules on MindSpore: embedding,
RMSNorm, attention projections, SwiGLU MLP and lm_head, each declaring its sharding with a
``ShardingConfig`` (no hp_tp).  ``parallelize(tp_mesh)`` shards it Megatron-style: vocab-parallel
embedding, column-parallel q/k/v, gate and up, row-parallel o and down, and an lm_head whose
logits stay sharded over the vocab for loss_parallel."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, mint, ops

from hp_dtensor import Replicate, Shard
from hp_protocols import BaseModel, MeshAxisName, Module, ShardingConfig

TP = MeshAxisName.TP


def colwise(bias: bool = False) -> ShardingConfig:
    state = {"weight": {TP: Shard(0)}} | ({"bias": {TP: Shard(0)}} if bias else {})
    return ShardingConfig(state_shardings=state, in_dst_shardings={"input": {TP: Replicate()}})


def rowwise() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(1)}},
        in_dst_shardings={"input": {TP: Shard(-1)}},
        out_dst_shardings={"output": {TP: Replicate()}},
    )


def replicated(*names: str) -> ShardingConfig:
    return ShardingConfig(state_shardings={n: {TP: Replicate()} for n in names})


class Linear(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        din: int
        dout: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = Parameter(Tensor(np.zeros((config.dout, config.din), np.float32)), name="weight")

    def construct(self, input: Any) -> Any:
        return ops.dense(input, self.weight)


class Embedding(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        vocab: int
        dim: int

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = Parameter(Tensor(np.zeros((config.vocab, config.dim), np.float32)), name="weight")

    def construct(self, ids: Any) -> Any:
        return ops.gather(self.weight, ids, 0)


class RMSNorm(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-6

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = Parameter(Tensor(np.ones((config.dim,), np.float32)), name="weight")

    def construct(self, x: Any) -> Any:
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.config.eps) * self.weight


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
        self.register_buffer("mask", Tensor(np.triu(np.full((config.seq, config.seq), -1e9, np.float32), 1)))

    def construct(self, x: Any) -> Any:
        b, s, d = x.shape  # global shapes: the heads split follows the projections' sharding
        heads = self.config.heads
        dh = d // heads

        def split(t: Any) -> Any:
            return mint.transpose(t.reshape(b, s, heads, dh), 1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = mint.matmul(q, mint.transpose(k, 2, 3)) * (1.0 / float(np.sqrt(dh))) + self.mask
        ctx = mint.matmul(ops.softmax(scores, -1), v)
        return self.o_proj(mint.transpose(ctx, 1, 2).reshape(b, s, d))


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

    def construct(self, x: Any) -> Any:
        return self.down(ops.silu(self.gate(x)) * self.up(x))


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
            state_shardings={"weight": {TP: Shard(0)}},  # vocab-parallel: partial sums, then all_reduce
            in_dst_shardings={"ids": {TP: Replicate()}},
            out_dst_shardings={"output": {TP: Replicate()}},
        )).build()
        self.attn_norm = RMSNorm.Config(dim=c.dim, sharding_config=replicated("weight")).build()
        self.attn = Attention.Config(dim=c.dim, heads=c.heads, seq=c.seq,
                                     sharding_config=replicated("mask")).build()
        self.mlp_norm = RMSNorm.Config(dim=c.dim, sharding_config=replicated("weight")).build()
        self.mlp = SwiGLU.Config(dim=c.dim, ffn=c.ffn).build()
        self.norm = RMSNorm.Config(dim=c.dim, sharding_config=replicated("weight")).build()
        # Logits stay Shard(-1) over the vocab: loss_parallel never gathers them.
        self.lm_head = Linear.Config(din=c.dim, dout=c.vocab, sharding_config=colwise()).build()

    def construct(self, ids: Any) -> Any:
        h = self.embed(ids)
        h = h + self.attn(self.attn_norm(h))
        h = h + self.mlp(self.mlp_norm(h))
        return self.lm_head(self.norm(h))
