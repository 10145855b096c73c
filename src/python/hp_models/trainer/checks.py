"""Before any rank starts: the model config, the layout the job and flags resolve to, and every
check a user can fix (exits with one message saying what to change)."""

from __future__ import annotations

import sys
from typing import Any

from hp_models.job import ModelSizes, Overrides, TrainLayout, plan, read_job, read_job_file
from hp_models.trainer.args import Args
from hp_models.trainer.backend import check_backend, launcher_world, missing_framework
from hp_models.trainer.checkpointing import check_checkpoint_dir
from hp_models.trainer.feature_flags import feature_overrides
from hp_models.trainer.lr_schedule import LRSchedule


def load_config(args: Args, raw: dict[str, Any] | None = None) -> Any:
    """The model config: ``tiny`` (with the job's ``model.num_hidden_layers`` when it names one:
    the pipeline examples use deeper tiny models) or a HF config.json.  ``raw``: the job file
    already read, if the caller has it."""
    from hp_models.qwen3_5 import tiny_config
    from hp_models.train_moe import TINY_MOE, config_from_file, config_from_name

    if args.config in ("tiny", TINY_MOE):
        layers = None
        if args.job is not None:
            facts = (raw if raw is not None else read_job_file(args.job)).get("model") or {}
            layers = facts.get("num_hidden_layers") if isinstance(facts, dict) else None
        depth = layers if isinstance(layers, int) and layers > 0 else None
        return config_from_name(args.config, depth) or (
            tiny_config(num_hidden_layers=depth) if depth is not None else tiny_config())
    return config_from_file(args.config)


def model_sizes(config: Any) -> ModelSizes:
    return ModelSizes(num_attention_heads=config.num_attention_heads, num_hidden_layers=config.num_hidden_layers,
                      num_experts=getattr(config, "num_experts", None))


def overrides(args: Args) -> Overrides:
    return Overrides(lr=args.lr, tp=args.tp, dp_shard=args.dp_shard, pp=args.pp, cp=args.cp, ep=args.ep,
                     global_batch_size=args.batch_size, local_batch_size=args.local_batch_size,
                     lr_warmup_steps=args.lr_warmup_steps, lr_decay=args.lr_decay, lr_decay_steps=args.lr_decay_steps,
                     lr_min=args.lr_min, max_grad_norm=args.max_grad_norm,
                     **feature_overrides(args.activation_checkpoint, args.ac_every, args.mixed_precision))


def check_args(args: Args) -> tuple[Any, TrainLayout]:
    """Everything that can be wrong before any rank starts; exits with a message saying what to change."""
    from hp_models.qwen3_5 import check_tp_size
    from hp_models.train_context import check_context
    from hp_models.train_moe import check_model

    env_world, variable = launcher_world(args.backend)
    world = int(env_world) if env_world is not None else args.nproc
    where = f"launched with {variable}={env_world}: " if env_world is not None else ""
    if env_world is not None and args.nproc is not None and args.nproc != world:
        sys.exit(f"error: {where}--nproc {args.nproc} disagrees with the launcher's ranks; drop --nproc")
    try:
        job = read_job(args.job) if args.job is not None else None
        raw = job.raw if job is not None else None
        config = load_config(args, raw)
        layout = plan(raw, overrides(args), model_sizes(config), world)
        # first: a torch-only feature is named as the trainer's, before a package's own platform check
        check_backend(args.backend, layout, checkpoint_format=args.checkpoint_format)
        check_tp_size(config, layout.tp)
        check_context(layout, config, args.seq_len)
        check_model(config, layout, args.seq_len)
        LRSchedule.of(layout.optim.lr, layout.optim, args.steps)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:
        sys.exit(f"error: {where}{e}")
    if layout.cp == 1 and args.seq_len % layout.tp:
        sys.exit(f"error: --seq-len {args.seq_len} must be divisible by --tp {layout.tp} (sequence parallelism)")
    missing = missing_framework(args.backend)
    if missing is not None:
        sys.exit(f"error: {missing}")
    check_checkpoint_dir(args, config, layout)
    if job is not None:
        job.announce()  # the sections and keys of a MindFormers file this trainer does not read
    return config, layout
