"""The trainer's side of checkpoints: the settings that make a run (a resume must share them)
and the checks of the checkpoint directory before any rank starts.  The saved state itself is
``hp_models.train_checkpoint``'s on torch and ``hp_models.trainer.mindspore.checkpoint``'s on
MindSpore (``hp_models.trainer.shards_checkpoint``: the layout both share)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.args import Args
from hp_models.trainer.lr_schedule import LRSchedule


def run_settings(args: Args, config: Any, layout: TrainLayout) -> dict[str, Any]:
    """What a resumed run must share with the run that saved its checkpoint."""
    from hp_models.trainer.resume import run_settings as settings

    optim = layout.optim
    schedule = LRSchedule.of(optim.lr, optim, args.steps)
    return settings(seed=args.seed, lr=optim.lr, seq_len=args.seq_len, global_batch_size=layout.global_batch_size,
                    model=dataclasses.asdict(config), lr_schedule=None if schedule.constant else schedule.as_dict(),
                    max_grad_norm=optim.max_grad_norm, weight_decay=optim.weight_decay, adam_betas=optim.betas,
                    adam_eps=optim.eps)


def check_checkpoint_dir(args: Args, config: Any, layout: TrainLayout) -> None:
    """Before any rank starts: the checkpoint directory is one (not a file); a fresh run does not
    write into another run's checkpoints (it would prune its own saves as older than theirs, and a
    later ``--resume`` would continue theirs), unless ``--overwrite``; ``--resume`` continues a
    checkpoint of this same run with steps left to train, in a format this backend reads (MindSpore
    reads safetensors-shards, not torch's DCP files); a pipeline-parallel run saves DCP only."""
    from hp_checkpoint.manifest import CheckpointKind, checkpoint_entries, complete_checkpoints
    from hp_dtensor.layout.shard_boxes import CheckpointError
    from hp_models.trainer.backend import Backend
    from hp_models.trainer.resume import resume_plan

    root = args.checkpoint_dir
    if layout.pp > 1 and args.save_format(layout.pp) == CheckpointKind.SAFETENSORS_SHARDS:
        # its save writes one tensor list for the whole job; a pipeline stage holds its own layers only
        sys.exit(f"error: --checkpoint-format safetensors-shards with pipeline_parallel={layout.pp}: that format "
                 f"needs every rank to hold every tensor (its own boxes of it), and a pipeline stage holds only its "
                 f"own layers; use --checkpoint-format dcp (the default under pipeline parallelism)")
    if os.path.exists(root) and not os.path.isdir(root):
        sys.exit(f"error: --checkpoint-dir {root} is a file, not a directory; pass a directory (it is created "
                 f"if missing) or move the file away")
    if args.resume:
        try:
            found = resume_plan(root, run_settings(args, config, layout), layout.as_dict())
        except CheckpointError as e:
            sys.exit(f"error: {e}")
        if found.step >= args.steps:
            sys.exit(f"error: --resume from {found.path} (step {found.step}) but --steps {args.steps}: nothing "
                     f"left to train; pass a larger --steps (the total, counting the steps already done)")
        if args.backend is Backend.MINDSPORE and found.kind != CheckpointKind.SAFETENSORS_SHARDS:
            sys.exit(f"error: --resume from {found.path}: a {found.kind} checkpoint (written by {found.framework}); "
                     f"the MindSpore backend resumes safetensors-shards checkpoints only (DCP is "
                     f"torch.distributed.checkpoint's format). Resume it with --backend torch, whose later "
                     f"checkpoints MindSpore can resume: --checkpoint-format safetensors-shards, the default "
                     f"when pipeline_parallel is 1")
        return
    steps = [os.path.basename(p) for p in checkpoint_entries(root) if os.path.basename(p).startswith("step-")]
    if steps and not args.overwrite:
        complete = [s for s, _ in complete_checkpoints(root)]
        sys.exit(f"error: --checkpoint-dir {root} already holds checkpoints of an earlier run ({len(steps)} step "
                 f"directories, {steps[0]} to {steps[-1]}; complete: steps {complete or 'none'}); a fresh run "
                 f"would mix its checkpoints with them. Pass --resume to continue that run, or --overwrite to "
                 f"delete them and start afresh (or choose another --checkpoint-dir)")


def clear_for_overwrite(args: Args) -> None:
    """``--overwrite``: delete the earlier run's checkpoints (once, before any rank saves)."""
    from hp_checkpoint.manifest import clear_checkpoints

    removed = clear_checkpoints(args.checkpoint_dir)
    if removed:
        print(f"--overwrite: deleted {len(removed)} checkpoint entries of an earlier run from "
              f"{args.checkpoint_dir}", file=sys.stderr, flush=True)
