# mypy: disable-error-code="no-untyped-def,import-not-found,import-untyped,attr-defined,arg-type,call-overload"
"""The consumer test's data, shared by the MindSpore and torch runs: the seed-004 job YAML, the
decoder's sizes, and weights / token ids / targets drawn from numpy seeds, so both frameworks,
every rank and the one-process reference start from the same numbers."""

from __future__ import annotations

import numpy as np

JOB_YAML = """
parallelism:
  data_parallel_shard: -1
  tensor_parallel: 2
  context_parallel: 1
  pipeline_parallel: 1
  expert_parallel: 1
training:
  local_batch_size: 2
model:
  num_attention_heads: 4
  num_hidden_layers: 1
"""

VOCAB, DIM, FFN, SEQ, BATCH = 16, 8, 16, 4, 2
STEPS, LR = 3, 0.01


def weights(seed: int = 4) -> dict[str, np.ndarray]:
    """Every parameter of the decoder by its state-dict path (the same on both frameworks)."""
    rs = np.random.RandomState(seed)

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rs.randn(*shape) * scale).astype(np.float32)

    return {
        "embed.weight": w(VOCAB, DIM, scale=1.0),
        "attn_norm.weight": 1.0 + w(DIM, scale=0.1),
        "attn.q_proj.weight": w(DIM, DIM), "attn.k_proj.weight": w(DIM, DIM),
        "attn.v_proj.weight": w(DIM, DIM), "attn.o_proj.weight": w(DIM, DIM),
        "mlp_norm.weight": 1.0 + w(DIM, scale=0.1),
        "mlp.gate.weight": w(FFN, DIM), "mlp.up.weight": w(FFN, DIM), "mlp.down.weight": w(DIM, FFN),
        "norm.weight": 1.0 + w(DIM, scale=0.1),
        "lm_head.weight": w(VOCAB, DIM),
    }


def batch(seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, next-token targets) of shape (BATCH, SEQ)."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    return ids[:, :-1].copy(), ids[:, 1:].copy()


def causal_mask() -> np.ndarray:
    return np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1)
