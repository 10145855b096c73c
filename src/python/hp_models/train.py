"""Train Qwen3.5 with FSDP/HSDP and tensor parallelism on CPU: ``python -m hp_models.train`` (README's main job).

With no flags: the built-in tiny config on the synthetic next-token task, tp=2 on 2 CPU ranks
spawned here (under ``torchrun`` the launcher's ranks are used instead).  ``--job job.yaml`` takes
a job file's ``parallelism:`` and ``training:`` sections (data_parallel_shard, tensor_parallel,
reshard_after_forward_policy, disable_gradient_division, global_batch_size, local_batch_size, ...);
flags given on the command line override it.  With ``pipeline_parallel`` (``--pp``) > 1 the layers
are split into stages (``pipeline_parallel_layers_per_stage``, interleave, overlap_p2p) with TP, CP and
FSDP inside each, and the accumulation micro-steps are the pipeline's microbatches
(``hp_models.train_pipeline``).  With ``context_parallel`` (``--cp``) > 1 each sequence is split
over the CP ranks (colossal, ulysses or hybrid; ``hp_models.train_context``) and FSDP shards over
``dp_shard * cp``; a job whose data set ``create_compressed_eod_mask`` trains on packed documents.
``--config tiny-moe`` trains the mixture-of-experts model, with its experts spread over
``expert_parallel`` (``--ep``) ranks (``hp_models.train_moe``).  World = pp * dp_replicate *
dp_shard * cp * tp ranks; each data-parallel rank trains on its slice of every global batch, in global_batch_size /
(local_batch_size * data_parallel) accumulation micro-steps.  Prints a progress bar, a summary,
writes ``loss.png``, ``log.json`` and TensorBoard event files (loss, learning rate, gradient norm,
tokens/s, peak memory per rank) to ``--out-dir``.  The learning rate follows the job's schedule
(``lr_warmup_steps``, ``lr_decay`` cosine or linear to ``lr_min``; constant by default) and
``max_grad_norm`` clips the gradients by their global norm over every mesh dim.

Checkpoints go to ``--checkpoint-dir`` as ``step-<N>/`` directories: sharded (each rank writes its
own shards: one safetensors file per rank, ``--checkpoint-format safetensors-shards``, the default;
or through ``torch.distributed.checkpoint``, ``dcp``, the default under pipeline parallelism),
atomic (staging directory, fsync, a manifest with checksums written last, rename) and holding the
model, the AdamW state keyed by parameter name, the step, the generator state, the data position
and the losses so far; the newest ``--keep`` complete ones are kept. ``--resume`` continues from
the newest complete checkpoint, under any parallelism (the state reshards on load), after verifying
it and checking that it was saved by the same run (seed, learning rate, model config, batch and
sequence sizes); a fresh run refuses a directory that holds another run's checkpoints unless told
``--overwrite``. Spawned ranks stop when the launcher dies, and the launcher stops when a rank
dies, naming the rank that died first and how. Errors a user can fix (a damaged checkpoint, a full
or read-only disk, a file where a directory should be) end the command with one line saying what to
do.

``--backend mindspore`` (or ``HYPER_PARALLEL_PLATFORM=mindspore``) trains the same job on MindSpore
(``hp_models.trainer.mindspore``): mccl CPU ranks started as ``msrun`` starts them, or this
process as ``msrun``'s scheduler or worker; tensor parallelism, FSDP/HSDP, the outputs and the
checkpoints as on torch, in the safetensors-shards format (``--checkpoint-format``; what it lacks
is refused before any rank starts).  A safetensors-shards checkpoint resumes on either backend,
under any parallelism.

This module is the command; its components (flags, checks, parallelize, data, step, optimizer
and learning-rate schedule, gradient norm, checkpointing, metrics, loop, spawn, outputs) are the
modules of ``hp_models.trainer``, and the names tests and callers use are re-exported here.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from hp_models.job import TrainLayout, single_process
from hp_models.launch import JobFailed
from hp_models.trainer.args import Args
from hp_models.trainer.args import parse_args as _parse_args
from hp_models.trainer.backend import Backend
from hp_models.trainer.checkpointing import check_checkpoint_dir, clear_for_overwrite, run_settings
from hp_models.trainer.checks import check_args, load_config, model_sizes, overrides
from hp_models.trainer.loop import fit, train
from hp_models.trainer.outputs import print_summary, write_outputs
from hp_models.trainer.parallelize import build_model
from hp_models.trainer.spawn import run_spawned, user_error
from hp_models.trainer.step import train_step


def parse_args(argv: list[str] | None = None) -> Args:
    return _parse_args(argv, description=(__doc__ or "").split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit code.  A failure it can explain (a rank died, a damaged
    checkpoint, a full disk) is printed as one ``error:`` line (by rank 0 only under torchrun)."""
    args = parse_args(argv)
    if args.backend is Backend.MINDSPORE:
        if "MS_ROLE" in os.environ and os.environ.get("HYPER_PARALLEL_PLATFORM") != "mindspore":
            # (the packages select their framework when first imported: before this line)
            sys.exit("error: under msrun, set HYPER_PARALLEL_PLATFORM=mindspore for --backend mindspore")
        os.environ["HYPER_PARALLEL_PLATFORM"] = "mindspore"  # what the ranks this command starts select
        os.environ.setdefault("GLOG_v", "3")  # MindSpore's own log: errors only, unless asked
    if args.backend is Backend.MINDSPORE and os.environ.get("MS_ROLE") == "MS_SCHED":
        # under msrun this command is also the scheduler: it serves the workers' rendezvous
        importlib.import_module("hp_models.trainer.mindspore.spawn").serve_scheduler()
        return 0
    config, layout = check_args(args)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if args.backend is Backend.MINDSPORE:
            return _run_mindspore(args, config, layout)
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
        # every rank has finished: leave the job now rather than in the interpreter's teardown
        current().destroy()
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
    print_summary(args, layout, result, log, single)
    return 0


def _run_mindspore(args: Args, config: Any, layout: TrainLayout) -> int:
    """The MindSpore backend: the ranks this command starts (scheduler and workers, as msrun
    starts them), or this worker of an msrun job; the outputs and checkpoints as on torch."""
    # (imported by name: the MindSpore backend belongs to the mindspore resolve, the launcher to both)
    ms = importlib.import_module("hp_models.trainer.mindspore.spawn")
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        if args.overwrite and os.environ.get("MS_NODE_ID") == "0":  # before the first save, which every rank joins
            clear_for_overwrite(args)
        rank, result = ms.run_launched(args, layout, config)
        if rank != 0:
            return 0
    else:
        if args.overwrite:
            clear_for_overwrite(args)
        result = ms.run_spawned_ms(args, layout, config)
    single = None
    if args.compare_single:
        from hp_checkpoint.manifest import clear_checkpoints

        one = single_process(layout, model_sizes(config))
        single_args = Args(**{**args.__dict__, "resume": False,
                              "checkpoint_dir": os.path.join(args.out_dir, "checkpoint-single")})
        clear_checkpoints(single_args.checkpoint_dir)  # the reference run's own, from an earlier command
        single = ms.run_spawned_ms(single_args, one, config, quiet=True)["losses"]
        single = single[-len(result["losses"]):]
    log = write_outputs(args, layout, config, result, single)
    print_summary(args, layout, result, log, single)
    return 0


__all__ = [
    "Args", "JobFailed", "build_model", "check_args", "check_checkpoint_dir", "clear_for_overwrite", "fit",
    "load_config", "main", "model_sizes", "overrides", "parse_args", "run_settings", "run_spawned", "train",
    "train_step", "user_error", "write_outputs",
]


if __name__ == "__main__":
    sys.exit(main())
