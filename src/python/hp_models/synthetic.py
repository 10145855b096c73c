"""A built-in next-token task a small model can visibly learn, deterministic per (seed, step).

Each sequence is an arithmetic progression modulo the vocabulary, ``x_t = (s + t * d) % V``, with
a random start ``s`` and a stride ``d`` from a small set: after two tokens the rest is
predictable, so the loss falls from ``ln V`` towards zero as the model learns the rule.
"""

from __future__ import annotations

import torch

STRIDES = (1, 2, 3, 5, 7, 11)


def batch(seed: int, step: int, batch_size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch_size, seq_len); targets are inputs shifted by one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (batch_size, 1), generator=g)]
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
