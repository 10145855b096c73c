"""Train Qwen3.5 with FSDP/HSDP and tensor parallelism on CPU: ``python -m hp_models.train`` (README's main job).

With no flags: the built-in tiny config on the synthetic next-token task, tp=2 on 2 CPU ranks
spawned here (under ``torchrun`` the launcher's ranks are used instead).  ``--job job.yaml`` takes
a job file's ``parallelism:`` and ``training:`` sections (data_parallel_shard, tensor_parallel,
reshard_after_forward_policy, disable_gradient_division, global_batch_size, local_batch_size, ...);
flags given on the command line override it.  With ``pipeline_parallel`` (``--pp``) > 1 the layers
are split into stages (``pipeline_parallel_layers_per_stage``, interleave, overlap_p2p) with TP and
FSDP inside each, and the accumulation micro-steps are the pipeline's microbatches
(``hp_models.train_pipeline``).  With ``context_parallel`` (``--cp``) > 1 each sequence is split
over the CP ranks (colossal, ulysses or hybrid; ``hp_models.train_context``) and FSDP shards over
``dp_shard * cp``; a job whose data set ``create_compressed_eod_mask`` trains on packed documents.
``--config tiny-moe`` trains the mixture-of-experts model, with its experts spread over
``expert_parallel`` (``--ep``) ranks (``hp_models.train_moe``).  World = pp * dp_replicate *
dp_shard * cp * tp ranks; each data-parallel rank trains on its slice of every global batch, in global_batch_size /
(local_batch_size * data_parallel) accumulation micro-steps.  Prints a progress bar, a summary,
writes ``loss.png`` and ``log.json`` to ``--out-dir``.

Checkpoints go to ``--checkpoint-dir`` as ``step-<N>/`` directories: sharded (each rank writes its
own shards through ``torch.distributed.checkpoint``), atomic (staging directory, fsync, a manifest
with checksums written last, rename) and holding the model, the AdamW state keyed by parameter
name, the step, the generator state, the data position and the losses so far; the newest
``--keep`` complete ones are kept.  ``--resume`` continues from the newest complete checkpoint,
under any parallelism (the state reshards on load), after verifying it and checking that it was
saved by the same run (seed, learning rate, model config, batch and sequence sizes); a fresh run
refuses a directory that holds another run's checkpoints unless told ``--overwrite``.  Spawned
ranks stop when the launcher dies, and the launcher stops when a rank dies, naming the rank that
died first and how.  Errors a user can fix (a damaged checkpoint, a full or read-only disk, a file
where a directory should be) end the command with one line saying what to do.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from hp_cp.config import MaskCompression
from hp_models.job import (
    DEFAULT_GLOBAL_BATCH_SIZE,
    ModelSizes,
    Overrides,
    TrainLayout,
    plan,
    read_job,
    read_job_file,
    single_process,
)
from hp_models.launch import JobFailed, launch
from hp_models.train_features_cli import add_feature_flags, feature_overrides  # [trainer-features]


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
    # [trainer-features] --activation-checkpoint, --ac-every, --mixed-precision (None: the job's)
    activation_checkpoint: str | None = None
    ac_every: int | None = None
    mixed_precision: str | None = None


def parse_args(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(prog="python -m hp_models.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default=None,
                   help="job YAML (a whole MindFormers file: parallelism:, training:'s batch sizes and model:'s "
                        "sizes are read, other sections are named once as ignored); flags override it")
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
    add_feature_flags(p)  # [trainer-features]
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
        activation_checkpoint=ns.activation_checkpoint, ac_every=ns.ac_every,  # [trainer-features]
        mixed_precision=ns.mixed_precision,
    )


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
    return Overrides(tp=args.tp, dp_shard=args.dp_shard, pp=args.pp, cp=args.cp, ep=args.ep,
                     global_batch_size=args.batch_size,
                     local_batch_size=args.local_batch_size,
                     **feature_overrides(args.activation_checkpoint, args.ac_every, args.mixed_precision))


def check_args(args: Args) -> tuple[Any, TrainLayout]:
    """Everything that can be wrong before any rank starts; exits with a message saying what to change."""
    from hp_models.qwen3_5 import check_tp_size
    from hp_models.train_context import check_context
    from hp_models.train_moe import check_model

    env_world = os.environ.get("WORLD_SIZE")
    world = int(env_world) if env_world is not None else args.nproc
    where = f"launched with WORLD_SIZE={env_world}: " if env_world is not None else ""
    if env_world is not None and args.nproc is not None and args.nproc != world:
        sys.exit(f"error: {where}--nproc {args.nproc} disagrees with the launcher's ranks; drop --nproc")
    try:
        job = read_job(args.job) if args.job is not None else None
        raw = job.raw if job is not None else None
        config = load_config(args, raw)
        layout = plan(raw, overrides(args), model_sizes(config), world)
        check_tp_size(config, layout.tp)
        check_context(layout, config, args.seq_len)
        check_model(config, layout)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:
        sys.exit(f"error: {where}{e}")
    if layout.cp == 1 and args.seq_len % layout.tp:
        sys.exit(f"error: --seq-len {args.seq_len} must be divisible by --tp {layout.tp} (sequence parallelism)")
    check_checkpoint_dir(args, config, layout)
    if job is not None:
        job.announce()  # the sections and keys of a MindFormers file this trainer does not read
    return config, layout


def run_settings(args: Args, config: Any, layout: TrainLayout) -> dict[str, Any]:
    """What a resumed run must share with the run that saved its checkpoint."""
    import dataclasses

    from hp_models.train_checkpoint import run_settings as settings

    return settings(seed=args.seed, lr=args.lr, seq_len=args.seq_len, global_batch_size=layout.global_batch_size,
                    model=dataclasses.asdict(config))


def check_checkpoint_dir(args: Args, config: Any, layout: TrainLayout) -> None:
    """Before any rank starts: the checkpoint directory is one (not a file); a fresh run does not
    write into another run's checkpoints (it would prune its own saves as older than theirs, and a
    later ``--resume`` would continue theirs), unless ``--overwrite``; ``--resume`` continues a
    checkpoint of this same run with steps left to train."""
    from hp_checkpoint.manifest import checkpoint_entries, complete_checkpoints
    from hp_dtensor.layout.shard_boxes import CheckpointError
    from hp_models.train_checkpoint import resume_plan

    root = args.checkpoint_dir
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


# ---------------------------------------------------------------- one rank
def build_model(args: Args, layout: TrainLayout, config: Any, *, distributed: bool) -> tuple[Any, int]:
    """The model with the seeded initial weights, then TP and FSDP applied as ``layout`` says
    (over the meshes built from it), and this rank's data-parallel index."""
    import torch

    from hp_models.activation_checkpoint import checkpoint_model_blocks
    from hp_models.mixed_precision import fsdp_policy, logits_in_float32
    from hp_models.qwen3_5 import apply_fsdp_qwen3_5, parallelize_qwen3_5_tp

    if layout.moe is not None:
        from hp_models.train_moe import build_moe_model

        return build_moe_model(args.seed, layout, config, distributed=distributed)
    torch.manual_seed(args.seed)
    model = config.build()
    model.init_weights()
    if not distributed:
        checkpoint_model_blocks(model, layout)  # [trainer-features] activation checkpointing
        return model, 0
    dims = layout.dims
    dense, _ = dims.build_mesh("cpu")  # (pp, dp_replicate, fsdp, tp)
    coord = dense.get_coordinate()
    assert coord is not None
    if layout.cp > 1:
        from hp_models.train_context import ContextParallelModel

        cp_model = ContextParallelModel(model, layout, dense)
        return cp_model, cp_model.dp_rank
    if layout.split is not None:
        from hp_models.train_pipeline import PipelinedModel

        return PipelinedModel(model, layout, dense), coord[1] * dims.dp_shard + coord[2]
    if dims.tp > 1:
        parallelize_qwen3_5_tp(model, dense["tp"])
    checkpoint_model_blocks(model, layout)  # [trainer-features] after TP (and CP), before fully_shard
    if layout.uses_fsdp:
        dp_mesh = dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else dense["fsdp"]
        apply_fsdp_qwen3_5(model, dp_mesh, reshard_after_forward=dims.reshard_after_forward,
                           sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload,
                           mp_policy=fsdp_policy(layout))  # [trainer-features] mixed precision
        logits_in_float32(model, layout)  # [trainer-features]
    return model, coord[1] * dims.dp_shard + coord[2]


def train_step(model: Any, layout: TrainLayout, dp_rank: int, ids: Any, tgt: Any, *, tp_loss: bool) -> float:
    """One optimizer step's forward and backward over the global batch ``ids``/``tgt`` (every rank
    passes the whole batch and takes its rows); returns the mean loss over the global batch.
    Gradients are left in ``.grad`` for the optimizer: those of the global mean loss."""
    import torch

    if layout.split is not None or layout.cp > 1:
        return model.train_step(dp_rank, ids, tgt)  # type: ignore[no-any-return]
    if layout.moe is not None:
        from hp_models.train_moe import moe_train_step

        return moe_train_step(model, layout, dp_rank, ids, tgt)
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


def train(args: Args, layout: TrainLayout, config: Any, rank: int, *, distributed: bool,
          quiet: bool = False) -> dict[str, Any]:
    import torch

    from hp_models import synthetic
    from hp_models.train_checkpoint import load_train_state, save_train_state
    from hp_models.train_moe import run_report

    model, dp_rank = build_model(args, layout, config, distributed=distributed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, losses = 0, list[float]()
    run = run_settings(args, config, layout)
    if args.resume:
        start, losses = load_train_state(args.checkpoint_dir, model, opt, seed=args.seed, announce=rank == 0,
                                         run=run, layout=layout.as_dict())
    show = rank == 0 and not quiet
    t0 = time.perf_counter()
    tokens = 0
    for step in range(start, args.steps):
        data = synthetic.packed_batch if layout.context.compression is MaskCompression.EOD else synthetic.batch
        ids, tgt = data(args.seed, step, layout.global_batch_size, args.seq_len, config.vocab_size)
        opt.zero_grad()
        value = train_step(model, layout, dp_rank, ids, tgt, tp_loss=distributed and layout.tp > 1)
        opt.step()
        losses.append(value)
        tokens += ids.numel()
        if show:
            _progress(step + 1, args.steps, value, tokens / max(time.perf_counter() - t0, 1e-9))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_train_state(args.checkpoint_dir, model, opt, step + 1, losses, seed=args.seed, keep=args.keep,
                             layout=layout.as_dict(), run=run)
    if show:
        sys.stderr.write("\n")
    elapsed = time.perf_counter() - t0
    nparams = getattr(model, "n_model_params", None) or sum(p.numel() for p in model.parameters())
    return {"losses": losses, "elapsed_s": elapsed, "tokens": tokens, "start_step": start, "nparams": nparams,
            **run_report(model)}


def _progress(step: int, total: int, loss: float, tok_s: float) -> None:
    width = 30
    filled = int(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    line = f"[{bar}] step {step}/{total}  loss {loss:.4f}  {tok_s:,.0f} tok/s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line)
    elif step == total or step % max(1, total // 20) == 0:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- launching
# Errors of the file system a user fixes (a full or read-only disk, a missing permission, a file
# in the way of a directory): reported as one line, not a traceback.
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                          errno.EEXIST, errno.EISDIR})


def user_error(error: BaseException) -> str | None:
    """One line for an error the user causes and can fix (a checkpoint that is damaged or of
    another run, a disk that refuses the files), else ``None``."""
    from hp_checkpoint.manifest import describe_os_error
    from hp_dtensor.layout.shard_boxes import CheckpointError

    if isinstance(error, CheckpointError):
        return " ".join(str(error).split("\n"))
    if isinstance(error, OSError) and error.errno in _USER_ERRNOS:
        return describe_os_error(error, "cannot write")
    return None


def _worker(rank: int, world: int, args: Args, layout: TrainLayout, store: str, results: Any,
            launcher_pid: int) -> None:
    try:
        from hp_models.launch import die_with_parent

        die_with_parent(launcher_pid)
        from hp_dtensor.platform import current

        plat = current()
        plat.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        plat.init_rank("gloo", store, rank, world, timeout_s=600)
        out = train(args, layout, load_config(args), rank, distributed=True)
        plat.destroy()
        results.put((rank, True, out if rank == 0 else None))
    except BaseException as e:
        line = user_error(e)
        results.put((rank, False, ("user", line) if line is not None else ("traceback", traceback.format_exc())))


def run_spawned(args: Args, layout: TrainLayout) -> dict[str, Any]:
    """Spawn the ranks and wait for them.  A rank that fails or dies (killed, out of memory) stops
    the job: the others are killed and the error names the rank; the ranks die with the launcher."""
    out: dict[str, Any] = launch(layout.world_size, _worker, (args, layout))
    return out


def write_outputs(args: Args, layout: TrainLayout, config: Any, result: dict[str, Any],
                  single: list[float] | None) -> dict[str, Any]:
    os.makedirs(args.out_dir, exist_ok=True)
    losses = result["losses"]
    log = {
        "config": args.config, "job": args.job, "tp": layout.tp, "steps": args.steps, "seq_len": args.seq_len,
        "batch_size": layout.global_batch_size, "parallelism": layout.as_dict(), "lr": args.lr, "seed": args.seed,
        "parameters": result["nparams"], "losses": losses, "first_loss": losses[0], "final_loss": losses[-1],
        "elapsed_s": result["elapsed_s"], "tokens_per_s": result["tokens"] / max(result["elapsed_s"], 1e-9),
        "resumed_from_step": result["start_step"],
    }
    if "tokens_per_expert" in result:
        log["tokens_per_expert"] = result["tokens_per_expert"]
    if single is not None:
        log["single_losses"] = single
        log["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(losses, single))
        log["max_loss_rel_diff_vs_single"] = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
    with open(os.path.join(args.out_dir, "log.json"), "w") as f:
        json.dump(log, f, indent=2)
    _plot(args, layout, losses, single, config.vocab_size)
    return log


def _plot(args: Args, layout: TrainLayout, losses: list[float], single: list[float] | None, vocab: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label=layout.describe())
    if single is not None:
        ax.plot(range(1, len(single) + 1), single, "--", label="1 process")
    ax.axhline(math.log(vocab), color="grey", lw=0.5, ls=":", label="ln(vocab): chance")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Qwen3.5 tiny, synthetic next-token task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "loss.png"), dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit code.  A failure it can explain (a rank died, a damaged
    checkpoint, a full disk) is printed as one ``error:`` line (by rank 0 only under torchrun)."""
    args = parse_args(argv)
    config, layout = check_args(args)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run(args, config, layout)
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        line = user_error(e)
        if line is None:
            raise
        if rank == 0:  # the checkpoint code raises the same error on every rank: print it once
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 1


def _run(args: Args, config: Any, layout: TrainLayout) -> int:
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        from hp_dtensor.platform import current

        rank = int(os.environ["RANK"])
        if args.overwrite and rank == 0:  # before the first save, which every rank joins
            clear_for_overwrite(args)
        current().ensure_process_group("cpu")
        result = train(args, layout, config, rank, distributed=layout.world_size > 1)
        if rank != 0:
            return 0
    else:
        if args.overwrite:
            clear_for_overwrite(args)
        if layout.world_size == 1:
            result = train(args, layout, config, 0, distributed=False)
        else:
            result = run_spawned(args, layout)
    single = None
    if args.compare_single:
        from hp_checkpoint.manifest import clear_checkpoints

        one = single_process(layout, model_sizes(config))
        single_args = Args(**{**args.__dict__, "resume": False,
                              "checkpoint_dir": os.path.join(args.out_dir, "checkpoint-single")})
        clear_checkpoints(single_args.checkpoint_dir)  # the reference run's own, from an earlier command
        single = train(single_args, one, config, 0, distributed=False, quiet=True)["losses"]
        single = single[-len(result["losses"]):]
    log = write_outputs(args, layout, config, result, single)
    print(f"\nQwen3.5 ({args.config}, {log['parameters']:,} parameters) trained with {layout.describe()}")
    first = result["losses"][result["start_step"]]
    print(f"  steps {result['start_step'] + 1}-{args.steps}: loss {first:.4f} -> {log['final_loss']:.4f}")
    if layout.dp > 1:
        print(f"  global batch {layout.global_batch_size} = data_parallel {layout.dp} x local batch "
              f"{layout.local_batch_size} x {layout.accumulation} accumulation step(s)")
    print(f"  {log['tokens_per_s']:,.0f} tokens/s, {log['elapsed_s']:.1f} s")
    if "tokens_per_expert" in result:
        from hp_models.train_moe import describe_load

        print("\n".join(describe_load(result["tokens_per_expert"])))
    if single is not None:
        print(f"  largest |loss({layout.describe()}) - loss(1 process)| over the run: "
              f"{log['max_loss_diff_vs_single']:.2e}")
    print(f"  wrote {os.path.join(args.out_dir, 'loss.png')}, {os.path.join(args.out_dir, 'log.json')}, "
          f"checkpoint in {args.checkpoint_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
