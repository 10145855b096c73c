"""Shared models, weights and rank functions for the MindSpore TP tests and the torch parity run.

Weights and inputs come from numpy seeds, so the MindSpore ranks, the torch ranks and the
single-process references all see the same numbers.  Every rank function returns numpy arrays:
local outputs and local gradients, which the tests assemble into global ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

B, S, H, FFN, HEADS = 2, 4, 8, 16, 4
DH = H // HEADS
VOCAB = 10


def weights(seed: int) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)

    def w(*shape: int) -> np.ndarray:
        return (rs.randn(*shape) * 0.3).astype(np.float32)

    return {
        "x": w(B, S, H), "g_hidden": w(B, S, H), "g_ffn": w(B, S, FFN),
        "w1": w(FFN, H), "b1": w(FFN), "w2": w(H, FFN), "b2": w(H),
        "q": w(H, H), "k": w(H, H), "v": w(H, H), "o": w(H, H), "o_b": w(H),
        "ln_w": 1.0 + w(H), "ln_b": w(H),
        "emb": w(VOCAB, H), "ids": rs.randint(0, VOCAB, size=(B, S)).astype(np.int32),
    }


def chunk(a: np.ndarray, dim: int, n: int, i: int) -> np.ndarray:
    return np.split(a, n, axis=dim)[i]


# ------------------------------------------------------------------ MindSpore side
def ms_dense(w: np.ndarray, b: np.ndarray | None) -> Any:
    from mindspore import Tensor, nn

    cell = nn.Dense(w.shape[1], w.shape[0], has_bias=b is not None)
    cell.weight.set_data(Tensor(w))
    if b is not None:
        cell.bias.set_data(Tensor(b))
    return cell


def ms_embedding(table: np.ndarray) -> Any:
    from mindspore import Tensor, nn

    cell = nn.Embedding(table.shape[0], table.shape[1])
    cell.embedding_table.set_data(Tensor(table))
    return cell


def ms_layer_norm(w: np.ndarray, b: np.ndarray) -> Any:
    from mindspore import Tensor, nn

    cell = nn.LayerNorm((w.shape[0],), begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)
    cell.gamma.set_data(Tensor(w))
    cell.beta.set_data(Tensor(b))
    return cell


def ms_mlp(W: dict[str, np.ndarray]) -> Any:
    from mindspore import nn

    class MLP(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.up = ms_dense(W["w1"], W["b1"])
            self.down = ms_dense(W["w2"], W["b2"])
            self.act = nn.ReLU()

        def construct(self, x: Any) -> Any:
            return self.down(self.act(self.up(x)))

    return MLP()


def ms_block(W: dict[str, np.ndarray]) -> Any:
    """The smallest Qwen-like attention block (test-matrix row D3): norm -> attention -> o_proj."""
    from mindspore import mint, nn, ops

    class Attention(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = ms_dense(W["q"], None)
            self.k_proj = ms_dense(W["k"], None)
            self.v_proj = ms_dense(W["v"], None)
            self.o_proj = ms_dense(W["o"], W["o_b"])

        def construct(self, h: Any) -> Any:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            b, s, width = q.shape  # local width: heads split by ColwiseParallel
            heads = width // DH

            def split(t: Any) -> Any:
                return mint.transpose(t.reshape(b, s, heads, DH), 1, 2)

            scores = mint.matmul(split(q), mint.transpose(split(k), 2, 3)) / float(np.sqrt(DH))
            ctx = mint.matmul(ops.softmax(scores, -1), split(v))
            return self.o_proj(mint.transpose(ctx, 1, 2).reshape(b, s, width))

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.norm = ms_layer_norm(W["ln_w"], W["ln_b"])
            self.attn = Attention()

        def construct(self, x: Any) -> Any:
            return self.attn(self.norm(x))

    return Block()


def ms_grads(cell: Any, x: Any, upstream: Any, *, input_grad: bool = True) -> dict[str, np.ndarray]:
    """Run ``cell(x)``, take loss = sum(output * upstream) on this rank (the global loss is the sum
    of the ranks' terms when outputs are sharded, or any rank's when they are replicated) and
    return the local output, the input gradient (``dx``, unless ``input_grad=False``: integer ids)
    and every parameter's local gradient (``d:<name>``)."""
    import mindspore as ms

    named = [(n, p) for n, p in cell.parameters_and_names() if p.requires_grad]
    names = [n for n, _ in named]
    params = [p for _, p in named]

    def loss_fn(inp: Any) -> Any:
        y = cell(inp)
        y = y.to_local() if hasattr(y, "placements") else y
        return (y * upstream).sum(), y

    (_, y), grads = ms.value_and_grad(loss_fn, 0 if input_grad else None, params, has_aux=True)(x)
    dx, dws = grads if input_grad else (None, grads)
    out = {"out": y.asnumpy()}
    if dx is not None:
        out["dx"] = dx.asnumpy()
    for name, g in zip(names, dws):
        out["d:" + name] = g.asnumpy()
    return out
