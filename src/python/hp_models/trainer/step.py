"""One optimizer step's forwards and backwards: the mean loss over the global batch, and its
gradients left in ``.grad`` (reduced over the data-parallel ranks, accumulated over micro-steps)."""

from __future__ import annotations

from typing import Any

from hp_cp.config import MaskCompression
from hp_models.job import TrainLayout


def train_step(model: Any, layout: TrainLayout, dp_rank: int, ids: Any, tgt: Any, *, tp_loss: bool) -> float:
    """One optimizer step's forward and backward over the global batch ``ids``/``tgt`` (every rank
    passes the whole batch and takes its rows); returns the mean loss over the global batch.
    Gradients are left in ``.grad`` for the optimizer: those of the global mean loss."""
    import torch

    if layout.moe is not None and layout.split is None:  # (also under context parallelism)
        from hp_models.train_moe import moe_train_step

        return moe_train_step(model, layout, dp_rank, ids, tgt)
    if layout.split is not None or layout.cp > 1:
        return model.train_step(dp_rank, ids, tgt)  # type: ignore[no-any-return]
    scale = layout.loss_scale()
    total = 0.0
    for micro in range(layout.accumulation):
        rows = layout.samples(dp_rank, micro)
        if layout.uses_fsdp:
            # Only the last micro-step's backward reduces the gradients; before it they accumulate locally.
            model.set_requires_gradient_sync(micro == layout.accumulation - 1)
        batch = (ids[rows], tgt[rows])
        if layout.context.compression is MaskCompression.EOD:  # packed documents: attention stays inside each
            from hp_models.train_context import documents_as_rows

            batch = documents_as_rows(*batch, model.config.vocab_size, multiple=layout.tp)
        total += _forward_backward(model, *batch, scale, tp_loss=tp_loss)
    if layout.dp == 1:
        return total / layout.accumulation
    import torch.distributed as dist

    # Each rank of a tensor-parallel group holds the same loss: the sum over all ranks is tp times
    # the sum over the data-parallel ranks.
    t = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / (layout.world_size * layout.accumulation)


def _forward_backward(model: Any, ids: Any, tgt: Any, scale: float, *, tp_loss: bool) -> float:
    import torch.nn.functional as F

    logits = model(ids)
    if tp_loss:
        from hp_tp import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
            (loss * scale if scale != 1.0 else loss).backward()
        return float(loss.full_tensor().item())  # type: ignore[attr-defined]
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    (loss * scale if scale != 1.0 else loss).backward()
    return float(loss.item())
