"""The data of each step: the global batch every rank draws alike (each rank then takes its own
rows), synthetic next-token rows, or packed documents when the job's data set says
``create_compressed_eod_mask``.  A function of the seed and the step, so a resumed run continues
the data from its step."""

from __future__ import annotations

from typing import Any

from hp_cp.config import MaskCompression
from hp_models.job import TrainLayout


def step_batch(seed: int, step: int, layout: TrainLayout, seq_len: int, vocab: int) -> tuple[Any, Any]:
    """``(ids, targets)`` of step ``step``'s global batch, ``(global_batch_size, seq_len)`` each."""
    from hp_models import synthetic

    data = synthetic.packed_batch if layout.context.compression is MaskCompression.EOD else synthetic.batch
    return data(seed, step, layout.global_batch_size, seq_len, vocab)
