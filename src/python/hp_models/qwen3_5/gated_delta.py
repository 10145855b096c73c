"""The gated delta rule (Gated DeltaNet's linear-attention recurrence) in chunked form.

Per head, the state ``S`` (k_dim x v_dim) evolves as ``S_t = exp(g_t) S_{t-1} (I - b_t k_t k_t^T)
+ b_t k_t v_t^T`` and the output is ``o_t = S_t^T q_t``.  Chunking the sequence turns the
sequential scan into a few matmuls per chunk (a unit-lower-triangular solve inside the chunk,
then one state update per chunk), which runs well on a CPU.  Heads are independent, so a rank
holding a subset of heads runs this on its heads only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and the recurrence compute in: fp32 for fp32 and lower precision, fp64
    kept (a float64 model computes in float64 throughout, for references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its ``compute_dtype`` (itself when already there)."""
    return x.to(compute_dtype(x.dtype))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Shared preparation: expand key heads over their value heads, move heads before the
    sequence, go to fp32, L2-normalize q and k and scale q by ``Dk ** -0.5``."""
    n_rep = v.shape[2] // k.shape[2]
    if n_rep > 1:
        q = q.repeat_interleave(n_rep, dim=2)
        k = k.repeat_interleave(n_rep, dim=2)
    q, k, v = (upcast(x.transpose(1, 2)) for x in (q, k, v))
    beta, g = upcast(beta.transpose(1, 2)).to(q.dtype), upcast(g.transpose(1, 2)).to(q.dtype)
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    return q, l2_normalize(k), v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64
) -> torch.Tensor:
    """q, k: (B, S, Hk, Dk); v: (B, S, Hv, Dv); g (log decay, <= 0), beta: (B, S, Hv).

    Returns (B, S, Hv, Dv).  Each key head serves ``Hv // Hk`` consecutive value heads; q and k
    are L2-normalized and q scaled by ``Dk ** -0.5``; the math runs in fp32."""
    return chunk_gated_delta_rule_with_state(q, k, v, g, beta, chunk_size)[0]


def chunk_gated_delta_rule_with_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule`` starting from ``initial_state`` (B, Hv, Dk, Dv) in fp32 (fp64 for a fp64 model) (zero
    when None), also returning the state after the last token.  A sequence cut in pieces gives
    the same outputs when each piece starts from the state the previous one ended with."""
    out_dtype = q.dtype
    seq = q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # (B, H, S, D) in fp32

    pad = (chunk_size - seq % chunk_size) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    b, h, total, dk = k.shape
    dv = v.shape[-1]
    n = total // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, h, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)  # log of the decay from the chunk start to each position
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()  # [i, j]: j -> i

    # Inside a chunk the updates interact through (I + strictly-lower(k_beta k^T * decay)); solve once.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    lower = torch.tril(system, -1) + torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    u = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)

    attn = (q @ k.transpose(-1, -2)) * decay  # causal, decayed, within the chunk
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, total, dv)[:, :, :seq]
    # padded positions have g = 0 and beta = 0: they leave the state as it was
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The same rule one step at a time (the definition; used to test the chunked form)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        kt, vt = k[:, :, t], v[:, :, t]
        delta = (vt - (state * kt.unsqueeze(-1)).sum(-2)) * beta[:, :, t, None]
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).contiguous().to(out_dtype)
