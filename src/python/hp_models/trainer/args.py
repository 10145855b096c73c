"""The train command's flags: ``Args`` and ``parse_args`` (numbers checked as argparse errors)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from hp_checkpoint.manifest import CheckpointKind
from hp_models.job import DEFAULT_GLOBAL_BATCH_SIZE
from hp_models.trainer.backend import Backend
from hp_models.trainer.feature_flags import add_feature_flags
from hp_protocols import LRDecay


@dataclass
class Args:
    job: str | None
    tp: int | None
    dp_shard: int | None
    pp: int | None
    ep: int | None
    nproc: int | None
    steps: int
    seq_len: int
    batch_size: int | None  # the global batch size
    local_batch_size: int | None
    lr: float | None  # the peak learning rate; None: the job's learning_rate, or 3e-3
    config: str
    out_dir: str
    checkpoint_dir: str
    checkpoint_every: int
    keep: int
    resume: bool
    seed: int
    compare_single: bool
    overwrite: bool = False
    cp: int | None = None
    # the learning-rate schedule and clipping; None: the job's ``training:`` field, or its default
    lr_warmup_steps: int | None = None
    lr_decay: str | None = None
    lr_decay_steps: int | None = None
    lr_min: float | None = None
    max_grad_norm: float | None = None
    # --activation-checkpoint, --ac-every, --mixed-precision (None: the job's)
    activation_checkpoint: str | None = None
    ac_every: int | None = None
    mixed_precision: str | None = None
    backend: Backend = Backend.TORCH  # --backend, else HYPER_PARALLEL_PLATFORM
    # --checkpoint-format; None: safetensors-shards, or DCP on torch under pipeline parallelism
    checkpoint_format: CheckpointKind | None = None

    def save_format(self, pp: int) -> CheckpointKind:
        """The format this run's checkpoints are written in, at pipeline degree ``pp``: the one asked
        for, else safetensors-shards (one file per rank: faster to save and load than DCP's record
        per tensor, and both frameworks resume it), except on torch under pipeline parallelism,
        where a stage holds only its own layers and DCP is the format that can save it."""
        if self.checkpoint_format is not None:
            return self.checkpoint_format
        if pp > 1 and self.backend is Backend.TORCH:
            return CheckpointKind.DCP
        return CheckpointKind.SAFETENSORS_SHARDS


def parse_args(argv: list[str] | None = None, description: str | None = None) -> Args:
    p = argparse.ArgumentParser(prog="python -m hp_models.train", description=description)
    p.add_argument("--job", default=None,
                   help="job YAML (a whole MindFormers file: parallelism:, training:, optimizer:, lr_schedule: and "
                        "model:'s sizes are read, other sections are named once as ignored); flags override it")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (tensor_parallel); default: the job's, or 2 without --job")
    p.add_argument("--dp-shard", type=int, default=None,
                   help="data_parallel_shard: ranks a parameter is sharded over; -1 = all data-parallel ranks")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline_parallel: stages the layers are split over (layers_per_stage 'auto' unless the "
                        "job lists them); the accumulation steps are the microbatches")
    p.add_argument("--cp", type=int, default=None,
                   help="context_parallel: ranks each sequence is split over (the job's context_parallel_method; "
                        "CP needs a compressed mask: the job's model.use_attn_mask_compression or "
                        "train_dataset.dataloader.config.create_compressed_eod_mask)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert_parallel: ranks the MoE model's experts are spread over (must divide "
                        "dp_shard * tp and the expert count); needs --config tiny-moe or a MoE config.json")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (world size); default: data_parallel_shard * tp * pp, or tp * pp when "
                        "data_parallel_shard is -1; more ranks than that make replicas (HSDP). Under torchrun: "
                        "the launcher's WORLD_SIZE")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (total, also when resuming)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", "--global-batch-size", dest="batch_size", type=int, default=None,
                   help=f"samples per optimizer step (global_batch_size); default: the job's, or {DEFAULT_GLOBAL_BATCH_SIZE}")
    p.add_argument("--local-batch-size", type=int, default=None,
                   help="samples per rank per forward (local_batch_size); default: the job's, or the global "
                        "batch over the data-parallel ranks (no accumulation)")
    p.add_argument("--lr", type=float, default=None,
                   help="the peak learning rate (constant without a schedule); default: the job's learning_rate "
                        "(training:, lr_schedule: or optimizer:), or 3e-3")
    p.add_argument("--lr-warmup-steps", type=int, default=None,
                   help="lr_warmup_steps: the learning rate rises linearly to --lr over these steps; default: the "
                        "job's, or 0")
    p.add_argument("--lr-decay", choices=[k.value for k in LRDecay], default=None,
                   help="lr_decay: after the warmup the learning rate falls to --lr-min along a half cosine or a "
                        "line, or stays (none); default: the job's, or none")
    p.add_argument("--lr-decay-steps", type=int, default=None,
                   help="lr_decay_steps: steps the decay takes; default: the job's, or the rest of the run "
                        "(--steps minus the warmup)")
    p.add_argument("--lr-min", type=float, default=None, help="lr_min: where the decay ends; default: the job's, or 0")
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="max_grad_norm: clip the gradients to this global norm (over every parameter, across every "
                        "mesh dim); default: the job's, or no clipping")
    p.add_argument("--config", default="tiny",
                   help="'tiny', 'tiny-moe' (8 experts, top-2) or the path of a HF config.json (dense or MoE)")
    p.add_argument("--out-dir", default="runs/qwen3_5-tp",
                   help="where loss.png, log.json and the TensorBoard event files (tensorboard/) go")
    p.add_argument("--checkpoint-dir", default=None, help="default: <out-dir>/checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (and at the end)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (the newest ones)")
    p.add_argument("--checkpoint-format", choices=[k.value for k in CheckpointKind], default=None,
                   help="how checkpoints are written: dcp (torch.distributed.checkpoint; torch only) or "
                        "safetensors-shards (one safetensors file per rank; torch and MindSpore write and resume "
                        "each other's); default: safetensors-shards, dcp under pipeline parallelism (a stage holds only "
                        "its own layers). --resume reads either")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (any parallelism)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even though --checkpoint-dir holds another run's checkpoints: "
                        "delete them first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-single", action="store_true",
                   help="also train on one process (same global batch) and report the largest loss gap")
    p.add_argument("--backend", choices=[b.value for b in Backend], default=None,
                   help="the framework that trains: torch, or mindspore (mccl CPU ranks started the way msrun "
                        "starts them: the main job with tp, dp_shard and HSDP, safetensors-shards checkpoints); default: "
                        "HYPER_PARALLEL_PLATFORM, else torch")
    add_feature_flags(p)
    ns = p.parse_args(argv)
    for name in ("tp", "pp", "cp", "ep", "nproc", "steps", "seq_len", "batch_size", "local_batch_size",
                 "checkpoint_every", "keep", "lr_decay_steps"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.dp_shard is not None and ns.dp_shard != -1 and ns.dp_shard < 1:
        p.error(f"--dp-shard must be -1 or >= 1, got {ns.dp_shard}")
    if ns.lr is not None and not ns.lr > 0:
        p.error(f"--lr must be > 0, got {ns.lr}")
    if ns.lr_warmup_steps is not None and ns.lr_warmup_steps < 0:
        p.error(f"--lr-warmup-steps must be >= 0, got {ns.lr_warmup_steps}")
    if ns.lr_min is not None and not ns.lr_min >= 0:
        p.error(f"--lr-min must be >= 0, got {ns.lr_min}")
    if ns.max_grad_norm is not None and not ns.max_grad_norm > 0:
        p.error(f"--max-grad-norm must be > 0, got {ns.max_grad_norm}")
    try:
        backend = Backend.resolve(ns.backend)
    except ValueError as e:
        p.error(str(e))
    if ns.resume and ns.overwrite:
        p.error("--resume continues the run in --checkpoint-dir, --overwrite deletes it: pass one of them")
    return Args(
        job=ns.job, tp=ns.tp, dp_shard=ns.dp_shard, pp=ns.pp, ep=ns.ep, nproc=ns.nproc, steps=ns.steps, seq_len=ns.seq_len,
        batch_size=ns.batch_size, local_batch_size=ns.local_batch_size, lr=ns.lr, config=ns.config,
        out_dir=ns.out_dir, checkpoint_dir=ns.checkpoint_dir or os.path.join(ns.out_dir, "checkpoint"),
        checkpoint_every=ns.checkpoint_every, keep=ns.keep, resume=ns.resume, seed=ns.seed, compare_single=ns.compare_single,
        overwrite=ns.overwrite, cp=ns.cp, lr_warmup_steps=ns.lr_warmup_steps, lr_decay=ns.lr_decay,
        lr_decay_steps=ns.lr_decay_steps, lr_min=ns.lr_min, max_grad_norm=ns.max_grad_norm,
        activation_checkpoint=ns.activation_checkpoint, ac_every=ns.ac_every, mixed_precision=ns.mixed_precision,
        backend=backend,
        checkpoint_format=CheckpointKind(ns.checkpoint_format) if ns.checkpoint_format is not None else None,
    )
