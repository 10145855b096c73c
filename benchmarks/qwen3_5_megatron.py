"""A hand-written Megatron-style tp Qwen3.5 (the limit ``qwen3_5_tp`` measures against): the same
model classes holding plain local shards of the same weights, no DTensor anywhere.

Heads, the MLP's intermediate and the vocab are split over ranks.  Without sequence parallelism a
token mixer's or MLP's input goes through ``_Copy`` (identity forward, all-reduce of the gradient
backward) and its output projection's result through ``_Reduce`` (all-reduce forward, identity
backward); the vocab-parallel embedding masks the ids of other ranks and all-reduces.  With
sequence parallelism activations between blocks hold a slice of the sequence: ``_Gather``
(all-gather forward, reduce-scatter backward) at a block's entry, ``_ReduceScatter`` (the reverse)
after its output projection and the embedding.  The loss is a vocab-parallel cross entropy (one
all-reduce of the row maxima, one of the stacked row sums).  Norm weights whose gradient is a
per-rank part (used on rank-local heads, or on a slice of the sequence) get one bucketed
all-reduce of their gradients after backward.  Every collective adds one to ``COUNT``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

COUNT = [0]


def _all_reduce(t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    COUNT[0] += 1
    dist.all_reduce(t, op=op)
    return t


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(g.contiguous())


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


def _gather_seq(x: torch.Tensor, world: int) -> torch.Tensor:
    """(B, S / world, ...) -> (B, S, ...), the ranks' slices in order."""
    COUNT[0] += 1
    xt = x.transpose(0, 1).contiguous()
    out = xt.new_empty((xt.shape[0] * world, *xt.shape[1:]))
    dist.all_gather_single(out, xt)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, world: int) -> torch.Tensor:
    """(B, S, ...) summed over ranks -> this rank's (B, S / world, ...)."""
    COUNT[0] += 1
    xt = x.transpose(0, 1).contiguous()
    out = xt.new_empty((xt.shape[0] // world, *xt.shape[1:]))
    dist.reduce_scatter_single(out, xt)
    return out.transpose(0, 1)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int) -> torch.Tensor:  # type: ignore[override]
        ctx.world = world
        return _gather_seq(x, world)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        return _reduce_scatter_seq(g, ctx.world), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int) -> torch.Tensor:  # type: ignore[override]
        ctx.world = world
        return _reduce_scatter_seq(x, world)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        return _gather_seq(g, ctx.world), None


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross entropy of logits (N, V / tp) holding vocab rows ``[lo, lo + V / tp)``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, lo: int) -> torch.Tensor:  # type: ignore[override]
        x = logits.float()
        m = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX)
        e = (x - m[:, None]).exp()
        local_t = target - lo
        mine = (local_t >= 0) & (local_t < x.shape[-1])
        idx = local_t.clamp(0, x.shape[-1] - 1)
        picked = torch.where(mine, x.gather(-1, idx[:, None])[:, 0] - m, torch.zeros_like(m))
        sums = _all_reduce(torch.stack([e.sum(-1), picked]))
        ctx.save_for_backward(e / sums[0][:, None], mine, idx)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        soft, mine, idx = ctx.saved_tensors
        grad = soft.clone()
        rows = torch.arange(grad.shape[0])
        grad[rows[mine], idx[mine]] -= 1.0
        return grad * (g / grad.shape[0]), None, None


class _VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, lo: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.lo = lo
        self.sp_world = 0  # > 0: sequence parallel over that many ranks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.lo
        mine = (local_ids >= 0) & (local_ids < self.weight.shape[0])
        out = nn.functional.embedding(local_ids.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine[..., None].to(out.dtype)
        if self.sp_world:
            return _ReduceScatter.apply(out, self.sp_world)  # type: ignore[no-any-return]
        return _Reduce.apply(out)  # type: ignore[no-any-return]


# (module path, parameter, dim split) of every sharded parameter, relative to a decoder layer
_LINEAR_ATTN = [(f"linear_attn.in_proj_{n}", "weight", 0) for n in "qkvzba"] + [
    ("linear_attn", n, 0) for n in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")
] + [("linear_attn.out_proj", "weight", 1)]
_FULL_ATTN = [(f"self_attn.{n}_proj", "weight", 0) for n in "qkv"] + [("self_attn.o_proj", "weight", 1)]
_MLP = [("mlp.gate_proj", "weight", 0), ("mlp.up_proj", "weight", 0), ("mlp.down_proj", "weight", 1)]
_PARTIAL = ["linear_attn.norm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
_PARTIAL_SP = ["input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight"]


def _hooks(world: int, sp: bool) -> tuple[Any, Any]:
    """(pre-hook on a block's input, hook on its output projection's result)."""

    def enter(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = _Gather.apply(args[0], world) if sp else _Copy.apply(args[0])
        return (x, *args[1:])

    def leave(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return _ReduceScatter.apply(out, world) if sp else _Reduce.apply(out)  # type: ignore[no-any-return]

    return enter, leave


class MegatronQwen3_5:
    """``ref`` (an unsharded Qwen3.5, untouched) split Megatron-style over the default group,
    with sequence parallelism when ``sp``."""

    def __init__(self, ref: Any, rank: int, world: int, *, sp: bool = False) -> None:
        if getattr(ref.config, "tie_word_embeddings", False):
            raise ValueError("the hand-written tp Qwen3.5 does not tie embeddings; build with tie_word_embeddings=False")
        self.model: Any = copy.deepcopy(ref)
        self.rank, self.world = rank, world
        self.shard_dims: dict[str, int] = {}  # parameter name -> dim split over ranks
        m = self.model
        vocab = m.config.vocab_size // world
        emb = m.model.embed_tokens.weight.detach().chunk(world, 0)[rank].clone()
        m.model.embed_tokens = _VocabParallelEmbedding(emb, rank * vocab)
        m.model.embed_tokens.sp_world = world if sp else 0
        self.shard_dims["model.embed_tokens.weight"] = 0
        self._shard(m, "lm_head", "weight", 0, "")
        enter, leave = _hooks(world, sp)
        m.lm_head.register_forward_pre_hook(enter)
        for i, layer in enumerate(m.model.layers):
            entries = (_LINEAR_ATTN if layer.layer_type == "linear_attention" else _FULL_ATTN) + _MLP
            for path, name, dim in entries:
                self._shard(layer, path, name, dim, f"model.layers.{i}.")
            mixer = layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn
            out = mixer.out_proj if layer.layer_type == "linear_attention" else mixer.o_proj
            for mod, proj in ((mixer, out), (layer.mlp, layer.mlp.down_proj)):
                mod.register_forward_pre_hook(enter)
                proj.register_forward_hook(leave)
        self.vocab_lo = rank * vocab
        partial = _PARTIAL + (_PARTIAL_SP if sp else [])
        self.partial = [p for n, p in m.named_parameters() if any(n.endswith(s) for s in partial)]

    def _shard(self, root: nn.Module, path: str, name: str, dim: int, prefix: str) -> None:
        mod = root.get_submodule(path)
        full = getattr(mod, name).detach()
        setattr(mod, name, nn.Parameter(full.chunk(self.world, dim)[self.rank].clone()))
        self.shard_dims[f"{prefix}{path}.{name}"] = dim

    def loss(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return _VocabParallelCE.apply(logits.flatten(0, 1), target.flatten(), self.vocab_lo)  # type: ignore[no-any-return]

    def finish_grads(self) -> None:
        """All-reduce the gradients of the norms used on rank-local heads, in one bucket."""
        grads = [p.grad for p in self.partial if p.grad is not None]
        if grads:
            flat = _all_reduce(torch.cat([g.flatten() for g in grads]))
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient (the shards gathered), by the unsharded model's names;
        for checking, not timed."""
        out = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            assert g is not None, f"{name} has no gradient: run a step first"
            dim = self.shard_dims.get(name)
            if dim is not None:
                parts = [torch.empty_like(g) for _ in range(self.world)]
                dist.all_gather(parts, g.contiguous())
                g = torch.cat(parts, dim)
            out[name] = g
        return out
