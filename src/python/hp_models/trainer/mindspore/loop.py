"""The training loop on one MindSpore rank: the torch trainer's loop (``hp_models.trainer.loop``)
with the same data, learning-rate schedule, gradient norm and clipping, metrics and progress bar;
the model, step and optimizer are this backend's.  No checkpoints yet (the trainer refuses
``--resume`` on this backend before any rank starts)."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.args import Args
from hp_models.trainer.data import step_batch
from hp_models.trainer.lr_schedule import LRSchedule
from hp_models.trainer.metrics import Metrics, progress, tensorboard_dir
from hp_models.trainer.mindspore.model import build_model_ms
from hp_models.trainer.mindspore.optimizer import AdamW
from hp_models.trainer.mindspore.step import StepRunner, every_rank


def train_ms(args: Args, layout: TrainLayout, config: Any, rank: int, weights: str, *, distributed: bool,
             quiet: bool = False) -> dict[str, Any]:
    """Train as ``args`` and ``layout`` say on this rank (every rank calls it), from the initial
    weights in the file ``weights`` (``initial_state_file``'s); the run's result, as
    ``hp_models.trainer.loop.train`` returns it.  ``quiet``: no progress bar, no event files."""
    from hp_fsdp import clip_grads

    model, dp_rank = build_model_ms(weights, layout, config, distributed=distributed)
    params = list(model.trainable_params())
    opt = AdamW(params, layout.optim)
    runner = StepRunner(model, params, layout, config.vocab_size, distributed=distributed)
    schedule = LRSchedule.of(layout.optim.lr, layout.optim, args.steps)
    max_norm = layout.optim.max_grad_norm
    show = rank == 0 and not quiet
    metrics = Metrics(rank, layout.world_size, distributed, tensorboard_dir(args.out_dir) if show else None,
                      every_rank=every_rank)
    losses: list[float] = []
    t0 = time.perf_counter()
    tokens = 0
    for step in range(args.steps):
        t_step = time.perf_counter()
        ids, tgt = step_batch(args.seed, step, layout, args.seq_len, config.vocab_size)
        value, grads = runner(dp_rank, ids.numpy(), tgt.numpy())
        # the global norm over every mesh dim (each gradient laid out as its parameter); without
        # max_grad_norm the scale is min(inf, 1) = 1 and the gradients pass unchanged
        clipped, norm = clip_grads(grads, max_norm if max_norm is not None else math.inf, parameters=params)
        opt.lr = schedule.at(step)
        opt.step(list(clipped))
        losses.append(value)
        tokens += int(ids.numel())
        metrics.record(step + 1, value, opt.lr, float(norm.asnumpy()), int(ids.numel()),
                       time.perf_counter() - t_step)
        if show:
            progress(step + 1, args.steps, value, opt.lr, tokens / max(time.perf_counter() - t0, 1e-9))
    metrics.close()
    if show:
        sys.stderr.write("\n")
    elapsed = time.perf_counter() - t0
    return {"losses": losses, "elapsed_s": elapsed, "tokens": tokens, "start_step": 0,
            "nparams": sum(math.prod(p.shape) for p in params),  # (a DTensor's shape is the whole one)
            "lr_schedule": schedule.as_dict(), "max_grad_norm": max_norm, **metrics.report()}

