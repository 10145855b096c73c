"""The training loop on one rank: build the model and optimizer, resume, then each step take the
batch, run the forwards and backwards, measure (and clip) the gradients' global norm, set the
step's learning rate, step the optimizer, record the metrics and save checkpoints."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.args import Args
from hp_models.trainer.checkpointing import run_settings
from hp_models.trainer.data import step_batch
from hp_models.trainer.grad_norm import GradNorm
from hp_models.trainer.lr_schedule import LRSchedule
from hp_models.trainer.metrics import Metrics, progress, tensorboard_dir
from hp_models.trainer.optimizer import build_optimizer, set_lr
from hp_models.trainer.parallelize import build_model
from hp_models.trainer.partial_grads import replicate_partial_grads
from hp_models.trainer.step import train_step


@dataclass
class Trained:
    """A finished run on this rank: its result (``train``'s) and the trained model."""

    result: dict[str, Any]
    model: Any


def fit(args: Args, layout: TrainLayout, config: Any, rank: int, *, distributed: bool,
        quiet: bool = False) -> Trained:
    """Train as ``args`` and ``layout`` say on this rank (every rank calls it).  ``quiet``: no
    progress bar and no event files (reference and test runs)."""
    from hp_models.train_checkpoint import load_train_state, save_train_state
    from hp_models.train_moe import run_report

    model, dp_rank = build_model(args, layout, config, distributed=distributed)
    opt = build_optimizer(model, layout.optim)
    schedule = LRSchedule.of(layout.optim.lr, layout.optim, args.steps)
    grad_norm = GradNorm(layout, distributed=distributed)
    start, losses = 0, list[float]()
    run = run_settings(args, config, layout)
    if args.resume:
        start, losses = load_train_state(args.checkpoint_dir, model, opt, seed=args.seed, announce=rank == 0,
                                         run=run, layout=layout.as_dict())
    show = rank == 0 and not quiet
    metrics = Metrics(rank, layout.world_size, distributed, tensorboard_dir(args.out_dir) if show else None,
                      fresh=start == 0)
    t0 = time.perf_counter()
    tokens = 0
    for step in range(start, args.steps):
        t_step = time.perf_counter()
        ids, tgt = step_batch(args.seed, step, layout, args.seq_len, config.vocab_size)
        opt.zero_grad()
        value = train_step(model, layout, dp_rank, ids, tgt, tp_loss=distributed and layout.tp > 1)
        replicate_partial_grads(model.parameters())
        norm = grad_norm(model, layout.optim.max_grad_norm)
        lr = schedule.at(step)
        set_lr(opt, lr)
        opt.step()
        losses.append(value)
        tokens += ids.numel()
        metrics.record(step + 1, value, lr, norm, ids.numel(), time.perf_counter() - t_step)
        if show:
            progress(step + 1, args.steps, value, lr, tokens / max(time.perf_counter() - t0, 1e-9))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_train_state(args.checkpoint_dir, model, opt, step + 1, losses, seed=args.seed, keep=args.keep,
                             layout=layout.as_dict(), run=run, fmt=args.save_format(layout.pp))
    metrics.close()
    if show:
        sys.stderr.write("\n")
    elapsed = time.perf_counter() - t0
    nparams = getattr(model, "n_model_params", None) or sum(p.numel() for p in model.parameters())
    result = {"losses": losses, "elapsed_s": elapsed, "tokens": tokens, "start_step": start, "nparams": nparams,
              "lr_schedule": schedule.as_dict(), "max_grad_norm": layout.optim.max_grad_norm,
              **metrics.report(), **run_report(model)}
    return Trained(result=result, model=model)


def train(args: Args, layout: TrainLayout, config: Any, rank: int, *, distributed: bool,
          quiet: bool = False) -> dict[str, Any]:
    """``fit``'s result: the losses, timings and metrics of the run."""
    return fit(args, layout, config, rank, distributed=distributed, quiet=quiet).result
