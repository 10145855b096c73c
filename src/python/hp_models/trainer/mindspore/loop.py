"""The training loop on one MindSpore rank: the torch trainer's loop (``hp_models.trainer.loop``)
with the same data, learning-rate schedule, gradient norm and clipping, metrics and progress bar;
the model, step and optimizer are this backend's.  Checkpoints at the torch trainer's cadence
(every ``--checkpoint-every`` steps and at the end, the newest ``--keep`` kept), in the
safetensors-shards format; ``--resume`` continues the newest, saved by either backend under any
parallelism (``hp_models.trainer.mindspore.checkpoint``)."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.args import Args
from hp_models.trainer.checkpointing import run_settings
from hp_models.trainer.data import step_batch
from hp_models.trainer.lr_schedule import LRSchedule
from hp_models.trainer.metrics import Metrics, progress, tensorboard_dir
from hp_models.trainer.mindspore.checkpoint import load_train_state_ms, save_train_state_ms
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
    start, losses = 0, list[float]()
    run = run_settings(args, config, layout)
    if args.resume:
        start, losses = load_train_state_ms(args.checkpoint_dir, model, opt, seed=args.seed, announce=rank == 0,
                                            run=run, layout=layout.as_dict())
    show = rank == 0 and not quiet
    metrics = Metrics(rank, layout.world_size, distributed, tensorboard_dir(args.out_dir) if show else None,
                      fresh=start == 0, every_rank=every_rank)
    t0 = time.perf_counter()
    tokens = 0
    for step in range(start, args.steps):
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
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_train_state_ms(args.checkpoint_dir, model, opt, step + 1, losses, seed=args.seed, keep=args.keep,
                                layout=layout.as_dict(), run=run)
    metrics.close()
    if show:
        sys.stderr.write("\n")
    elapsed = time.perf_counter() - t0
    return {"losses": losses, "elapsed_s": elapsed, "tokens": tokens, "start_step": start,
            "nparams": sum(math.prod(p.shape) for p in params),  # (a DTensor's shape is the whole one)
            "lr_schedule": schedule.as_dict(), "max_grad_norm": max_norm, **metrics.report()}

