"""The gated delta rule in chunked form on MindSpore PyNative: the same algorithm, step for step,
as the torch model's ``hp_models.qwen3_5.gated_delta`` (see there for the recurrence), so the two
frameworks agree to float rounding.

Per head the state ``S`` (k_dim x v_dim) evolves as ``S_t = exp(g_t) S_{t-1} (I - b_t k_t k_t^T)
+ b_t k_t v_t^T`` and the output is ``o_t = S_t^T q_t``; inside a chunk the updates interact
through a unit-lower-triangular system, solved once per chunk, then one state update per chunk.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore.scipy.linalg import solve_triangular


def compute_dtype(dtype: Any) -> Any:
    """The dtype norms and the recurrence compute in: fp32, or fp64 for a fp64 model."""
    return ms.float64 if dtype == ms.float64 else ms.float32


def upcast(x: Tensor) -> Tensor:
    """``x`` in its ``compute_dtype`` (itself when already there)."""
    want = compute_dtype(x.dtype)
    return x if x.dtype == want else x.astype(want)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * ops.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _heads_first(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """Expand key heads over their value heads, move heads before the sequence, upcast,
    L2-normalize q and k and scale q by ``Dk ** -0.5``."""
    n_rep = v.shape[2] // k.shape[2]
    if n_rep > 1:
        q = ops.repeat_interleave(q, n_rep, 2)
        k = ops.repeat_interleave(k, n_rep, 2)
    q, k, v = (upcast(x.swapaxes(1, 2)) for x in (q, k, v))
    beta, g = upcast(beta.swapaxes(1, 2)).astype(q.dtype), upcast(g.swapaxes(1, 2)).astype(q.dtype)
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    return q, l2_normalize(k), v, g, beta


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64
) -> Tensor:
    """q, k: (B, S, Hk, Dk); v: (B, S, Hv, Dv); g (log decay, <= 0), beta: (B, S, Hv).

    Returns (B, S, Hv, Dv); each key head serves ``Hv // Hk`` consecutive value heads."""
    out_dtype = q.dtype
    seq = q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # (B, H, S, D)

    pad = (chunk_size - seq % chunk_size) % chunk_size
    if pad:
        q, k, v = (ops.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = ops.pad(beta, (0, pad)), ops.pad(g, (0, pad))
    b, h, total, dk = k.shape
    dv = v.shape[-1]
    n = total // chunk_size

    def chunks(x: Tensor) -> Tensor:
        return x.reshape(b, h, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    k_beta = k * beta.expand_dims(-1)
    v_beta = v * beta.expand_dims(-1)
    cum = ops.cumsum(g, -1)  # log of the decay from the chunk start to each position
    future = Tensor(np.triu(np.ones((chunk_size, chunk_size), np.bool_), 1))
    diff = cum.expand_dims(-1) - cum.expand_dims(-2)
    decay = ops.exp(ops.masked_fill(diff, future, float("-inf")))  # [i, j]: j -> i
    eye = Tensor(np.eye(chunk_size), q.dtype)

    system = ops.matmul(k_beta, k.swapaxes(-1, -2)) * decay
    lower = ops.tril(system, -1) + eye
    u = solve_triangular(lower, v_beta, lower=True, unit_diagonal=True)
    w = solve_triangular(lower, k_beta * ops.exp(cum).expand_dims(-1), lower=True, unit_diagonal=True)

    attn = ops.matmul(q, k.swapaxes(-1, -2)) * decay  # causal, decayed, within the chunk
    q_decayed = q * ops.exp(cum).expand_dims(-1)
    k_to_end = k * ops.exp(cum[..., -1:] - cum).expand_dims(-1)
    chunk_decay = ops.exp(cum[..., -1])

    # one chunk at a time along the sequence (unstacked once: per-chunk indexing is slow in PyNative)
    u_, w_, qd_, attn_ = ops.unstack(u, 2), ops.unstack(w, 2), ops.unstack(q_decayed, 2), ops.unstack(attn, 2)
    kt_ = ops.unstack(k_to_end.swapaxes(-1, -2), 2)
    cd_ = ops.unstack(chunk_decay.expand_dims(-1).expand_dims(-1), 2)
    state = ops.zeros((b, h, dk, dv), q.dtype)
    outs = []
    for i in range(n):
        v_new = u_[i] - ops.matmul(w_[i], state)
        outs.append(ops.matmul(qd_[i], state) + ops.matmul(attn_[i], v_new))
        state = state * cd_[i] + ops.matmul(kt_[i], v_new)
    out = ops.stack(outs, 2).reshape(b, h, total, dv)[:, :, :seq]
    # padded positions have g = 0 and beta = 0: they leave the state as it was
    return out.swapaxes(1, 2).astype(out_dtype)
