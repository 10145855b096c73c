# mypy: disable-error-code="import-not-found,import-untyped"
"""The torch half of the cross-backend parity test: the same modules and weights as ``ms_cases``
built with torch.nn, parallelized by the same hp_tp styles on the torch backend (gloo ranks)."""

from __future__ import annotations

from typing import Any

import numpy as np
from ms_cases import DH


def t_linear(w: np.ndarray, b: np.ndarray | None) -> Any:
    import torch

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        if b is not None:
            lin.bias.copy_(torch.from_numpy(b))
    return lin


def t_mlp(W: dict[str, np.ndarray]) -> Any:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = t_linear(W["w1"], W["b1"])
            self.down = t_linear(W["w2"], W["b2"])

        def forward(self, x: Any) -> Any:
            return self.down(torch.relu(self.up(x)))

    return MLP()


def t_block(W: dict[str, np.ndarray]) -> Any:
    import torch

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = t_linear(W["q"], None)
            self.k_proj = t_linear(W["k"], None)
            self.v_proj = t_linear(W["v"], None)
            self.o_proj = t_linear(W["o"], W["o_b"])

        def forward(self, h: Any) -> Any:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            b, s, width = q.shape
            heads = width // DH

            def split(t: Any) -> Any:
                return t.reshape(b, s, heads, DH).transpose(1, 2)

            scores = split(q) @ split(k).transpose(2, 3) / float(np.sqrt(DH))
            ctx = torch.softmax(scores, -1) @ split(v)
            return self.o_proj(ctx.transpose(1, 2).reshape(b, s, width))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(W["ln_w"].shape[0], eps=1e-5)
            with torch.no_grad():
                self.norm.weight.copy_(torch.from_numpy(W["ln_w"]))
                self.norm.bias.copy_(torch.from_numpy(W["ln_b"]))
            self.attn = Attention()

        def forward(self, x: Any) -> Any:
            return self.attn(self.norm(x))

    return Block()


def t_grads(module: Any, x: np.ndarray, upstream: np.ndarray) -> dict[str, np.ndarray]:
    """Like ``ms_cases.ms_grads``: local output, input gradient, and each parameter's gradient in
    the parameter's own layout (local shard of a sharded weight, whole for a replicated one)."""
    import torch

    xt = torch.from_numpy(np.ascontiguousarray(x)).requires_grad_(True)
    y = module(xt)
    if hasattr(y, "placements"):
        y = y.to_local()
    (y * torch.from_numpy(np.ascontiguousarray(upstream))).sum().backward()
    assert xt.grad is not None
    out = {"out": y.detach().numpy(), "dx": xt.grad.numpy()}
    for name, p in module.named_parameters():
        g = p.grad
        if hasattr(g, "placements"):
            g = g.redistribute(placements=p.placements).to_local()
        out["d:" + name] = g.detach().numpy()
    return out
