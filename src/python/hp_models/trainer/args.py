"""The train command's flags: ``Args`` and ``parse_args`` (numbers checked as argparse errors)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from hp_models.job import DEFAULT_GLOBAL_BATCH_SIZE


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
    lr: float
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


def parse_args(argv: list[str] | None = None, description: str | None = None) -> Args:
    p = argparse.ArgumentParser(prog="python -m hp_models.train", description=description)
    p.add_argument("--job", default=None, help="job YAML with parallelism: and training: sections; flags override it")
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
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--config", default="tiny",
                   help="'tiny', 'tiny-moe' (8 experts, top-2) or the path of a HF config.json (dense or MoE)")
    p.add_argument("--out-dir", default="runs/qwen3_5-tp", help="where loss.png and log.json go")
    p.add_argument("--checkpoint-dir", default=None, help="default: <out-dir>/checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (and at the end)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (the newest ones)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (any parallelism)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even though --checkpoint-dir holds another run's checkpoints: "
                        "delete them first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-single", action="store_true",
                   help="also train on one process (same global batch) and report the largest loss gap")
    ns = p.parse_args(argv)
    for name in ("tp", "pp", "cp", "ep", "nproc", "steps", "seq_len", "batch_size", "local_batch_size",
                 "checkpoint_every", "keep"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.dp_shard is not None and ns.dp_shard != -1 and ns.dp_shard < 1:
        p.error(f"--dp-shard must be -1 or >= 1, got {ns.dp_shard}")
    if ns.lr <= 0:
        p.error(f"--lr must be > 0, got {ns.lr}")
    if ns.resume and ns.overwrite:
        p.error("--resume continues the run in --checkpoint-dir, --overwrite deletes it: pass one of them")
    return Args(
        job=ns.job, tp=ns.tp, dp_shard=ns.dp_shard, pp=ns.pp, ep=ns.ep, nproc=ns.nproc, steps=ns.steps, seq_len=ns.seq_len,
        batch_size=ns.batch_size, local_batch_size=ns.local_batch_size, lr=ns.lr, config=ns.config,
        out_dir=ns.out_dir, checkpoint_dir=ns.checkpoint_dir or os.path.join(ns.out_dir, "checkpoint"),
        checkpoint_every=ns.checkpoint_every, keep=ns.keep, resume=ns.resume, seed=ns.seed, compare_single=ns.compare_single,
        overwrite=ns.overwrite, cp=ns.cp,
    )
