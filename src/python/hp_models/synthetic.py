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


def eod_token(vocab: int) -> int:
    """The end-of-document token of packed batches: the vocabulary's last id, which no document
    of ``packed_batch`` uses otherwise."""
    return vocab - 1


def packed_batch(seed: int, step: int, batch_size: int, seq_len: int, vocab: int, *, min_doc: int = 4,
                 max_doc: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of packed documents (EOD data), each (batch_size, seq_len), deterministic
    per (seed, step): every row concatenates documents of ``min_doc`` to ``max_doc`` tokens, each a
    progression of its own modulo ``vocab - 1`` ended by ``eod_token(vocab)``; the last one is cut
    at the row's end.  Targets are inputs shifted by one (a document's EOD predicts the next
    document's first token, which no model can: that part of the loss stays)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 500_009)
    span = vocab - 1
    rows = []
    for _ in range(batch_size):
        row: list[int] = []
        while len(row) < seq_len + 1:
            n = int(torch.randint(min_doc, max_doc + 1, (1,), generator=g))
            start = int(torch.randint(0, span, (1,), generator=g))
            stride = STRIDES[int(torch.randint(0, len(STRIDES), (1,), generator=g))]
            row += [(start + stride * t) % span for t in range(n - 1)] + [eod_token(vocab)]
        rows.append(row[:seq_len + 1])
    seq = torch.tensor(rows, dtype=torch.long)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
