"""The leaf layers of Qwen3.5 on MindSpore, as protocol Modules holding torch's parameter names
(``weight``), so the model's state-dict keys equal the torch model's: linear, embedding, the
zero-centred RMSNorm, the gated per-head RMSNorm, and the partial rotary embedding."""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from hp_dtensor.platform import current
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_models.qwen3_5.mindspore.gated_delta import upcast
from hp_protocols import Module


def local(t: Any) -> Any:
    """This rank's values of ``t`` (itself when it is not a DTensor): token mixers compute on the
    heads a rank holds."""
    return t.to_local() if isinstance(t, current().DTensor) else t


def local_param(p: Any) -> Any:
    """This rank's shard of parameter ``p`` (a DTensor after ``parallelize``) for local
    computation; its gradient reaches the parameter."""
    if not isinstance(p, current().DTensor):
        return p
    return p.to_local()


def _param(*shape: int, fill: float = 0.0, dtype: Any = ms.float32) -> Parameter:
    return Parameter(Tensor(np.full(shape, fill, np.float32), dtype), name="weight")


class Linear(Module):
    """``y = x W^T (+ b)`` with ``weight`` (out, in), torch's ``nn.Linear`` layout."""

    def __init__(self, din: int, dout: int, bias: bool = False, dtype: Any = ms.float32) -> None:
        super().__init__()
        self.weight = _param(dout, din, dtype=dtype)
        self.bias = Parameter(Tensor(np.zeros((dout,), np.float32), dtype), name="bias") if bias else None

    def construct(self, input: Any) -> Any:
        return ops.dense(input, self.weight, self.bias)


class Embedding(Module):
    """Rows of ``weight`` (vocab, hidden) by token id; the ``padding_idx`` row gets no gradient
    (as torch's ``nn.Embedding(padding_idx=...)``)."""

    def __init__(self, vocab: int, dim: int, padding_idx: int | None = None, dtype: Any = ms.float32) -> None:
        super().__init__()
        self.padding_idx = padding_idx
        self.weight = _param(vocab, dim, dtype=dtype)

    def construct(self, ids: Any) -> Any:
        out = ops.gather(self.weight, ids, 0)
        if self.padding_idx is not None:
            pad = (ids == self.padding_idx).expand_dims(-1)
            out = ops.where(pad, ops.stop_gradient(out), out)
        return out


class RMSNorm(Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + weight)``, computed in fp32 (weight starts at 0)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: Any = ms.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)

    def _init_param(self, name: str, param: Any) -> None:
        param.set_data(ops.zeros(param.shape, param.dtype))

    def construct(self, x: Any) -> Any:
        xf = upcast(x)
        out = xf * ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + self.eps)
        return (out * (1.0 + upcast(self.weight))).astype(x.dtype)


class GatedRMSNorm(Module):
    """RMSNorm over each value head, times ``silu(gate)`` (weight starts at 1)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: Any = ms.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, fill=1.0, dtype=dtype)

    def construct(self, x: Any, gate: Any) -> Any:
        dtype = x.dtype
        xf = upcast(x)
        xf = xf * ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + self.eps)
        out = self.weight * xf.astype(dtype)
        return (out * ops.silu(upcast(gate))).astype(dtype)


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def apply_rotary(x: Any, cos: Any, sin: Any) -> Any:
    """Rotate the first ``rotary_dim`` channels of (B, H, S, D); the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return ops.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), -1)


class RotaryEmbedding(Module):
    """cos and sin tables (1, 1, S, rotary_dim) of the partial rotary embedding (no parameters)."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        dim = config.rotary_dim
        exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        self.inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)

    def construct(self, seq_len: int, dtype: Any) -> tuple[Any, Any]:
        pos = Tensor(np.arange(seq_len, dtype=np.float32))
        freqs = ops.outer(pos, Tensor(self.inv_freq))
        emb = ops.cat((freqs, freqs), -1).reshape(1, 1, seq_len, -1)
        return ops.cos(emb).astype(dtype), ops.sin(emb).astype(dtype)
