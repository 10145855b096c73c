"""The trainer's checkpoint on torch: everything a resumed run needs to continue the loss curve exactly.

In the DCP format (``--checkpoint-format dcp``, the default under pipeline parallelism) it is saved through
``hp_checkpoint.atomic`` (sharded, atomic, verified):

- ``model``: the parameters as the model holds them (DTensors: each rank writes its shards);
- ``optim``: AdamW's state keyed by parameter name, so it reshards with the parameters when the
  run resumes under another parallelism;
- ``rng.torch_cpu``: the default CPU generator's state.  Random ops on DTensors draw from that
  generator on every rank alike (the RNG tracker keeps no other state), so one copy serves every
  rank and every layout; a save checks that the ranks agree;
- in the manifest's ``extra``: the step, the data position (the index of the next synthetic
  batch), the seed, the losses so far, the layout that saved it and the run's settings (seed,
  learning rate and its schedule, gradient clipping, sequence length, global batch, optimizer,
  model config).  The learning rate of a step is a function of the step alone, so the schedule
  needs no state of its own.

In the safetensors-shards format (``--checkpoint-format safetensors-shards``, the default) the same state is
saved in the layout both backends share (``hp_models.trainer.shards_checkpoint``), so a MindSpore
run resumes it, and a torch run resumes a MindSpore run's.  A resume reads whichever format the
newest checkpoint has.

``--resume`` continues only the run that saved the checkpoint (``hp_models.trainer.resume``): a
different layout (tp, dp_shard, replicas, micro-batches) or framework is allowed and announced,
the state reshards on load.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch

from hp_checkpoint.atomic import load_checkpoint, save_checkpoint
from hp_checkpoint.dcp import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from hp_checkpoint.manifest import CheckpointKind
from hp_dtensor.layout.shard_boxes import CheckpointError
from hp_dtensor.platform.torch.collectives import all_gather_object
from hp_models.trainer.resume import (
    RUN_KEYS,
    ResumePlan,
    check_resumed,
    resume_plan,
    run_settings,
    train_record,
    trainer_extra,
)
from hp_models.trainer.shards_checkpoint import MOMENTS, load_train_shards, save_train_shards, train_state

__all__ = ["RUN_KEYS", "ResumePlan", "load_train_state", "resume_plan", "run_settings", "save_train_state"]

def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "rng": {"torch_cpu": torch.get_rng_state()},
    }


def _check_rng_agrees() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    every = all_gather_object(mine)  # through the collectives module: counted, one path
    if len(set(every)) != 1:
        raise CheckpointError(
            "checkpoint: the ranks' CPU generator states differ, so one saved state cannot restore them; "
            "draw random numbers through DTensor ops or on every rank alike"
        )


def _shards_state(model: torch.nn.Module, opt: torch.optim.Optimizer, *, rng: bool = True) -> dict[str, Any]:
    """The state in the layout both backends share (``hp_models.trainer.shards_checkpoint``): the
    optimizer's own moment tensors (created as its first step would start them), so a load fills
    them in place."""
    optim = get_optimizer_state_dict(model, opt)
    steps = {int(s["step"]) for s in optim["state"].values()}
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint: AdamW's parameters are at different step counts {sorted(steps)}; the "
                              f"trainer steps every parameter together")
    moments = {fqn: {k: s[k] for k in MOMENTS} for fqn, s in optim["state"].items()}
    return train_state(get_model_state_dict(model), moments, steps.pop() if steps else 0,
                       torch.get_rng_state() if rng else None)


def save_train_state(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                     losses: list[float], *, seed: int, keep: int, layout: dict[str, Any],
                     run: dict[str, Any] | None = None, fmt: CheckpointKind = CheckpointKind.DCP) -> str:
    """Save the state after ``step`` optimizer steps as ``<root>/step-<N>``; collective.  ``run``:
    the run's settings (``run_settings``), which a resume must match.  ``fmt``: DCP (torch's own
    files) or safetensors-shards (the layout MindSpore reads too)."""
    _check_rng_agrees()
    extra = train_record(step, losses, seed=seed, layout=layout, run=run)
    if fmt == CheckpointKind.SAFETENSORS_SHARDS:
        return save_train_shards(_shards_state(model, opt), root, step, extra, keep)
    return save_checkpoint(_state(model, opt), root, step, extra=extra, keep=keep)


def load_train_state(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer, *, seed: int,
                     announce: bool, run: dict[str, Any] | None = None,
                     layout: dict[str, Any] | None = None) -> tuple[int, list[float]]:
    """Load the newest complete checkpoint under ``root`` into ``model``/``opt`` and the generator
    (any parallelism; DCP, or safetensors-shards written by either framework: a MindSpore one
    carries no generator state, and the trainer draws no random numbers after the weights'
    initialization); returns ``(step, losses)``.  Raises ``CheckpointError`` on every rank when
    there is none, when it was saved by a run with other settings, or when it fails verification
    (naming the file or tensor).  ``announce``: print which checkpoint, the newer step directories
    skipped and why, and the layout changes."""
    plan = resume_plan(root, run if run is not None else {"seed": seed}, layout or {})
    step, path = plan.step, plan.path
    if announce:
        print(plan.announcement(), file=sys.stderr, flush=True)
    if plan.kind == CheckpointKind.SAFETENSORS_SHARDS:
        return step, _load_shards(root, path, step, model, opt, seed)
    state = _state(model, opt)
    # This run's own parameter names per group: a pipeline stage saved only its own, and the
    # saved lists are one rank's, so each rank names the parameters it holds (the trainer's one
    # group holds every parameter of the model it trains).
    own_params = [list(g["params"]) for g in state["optim"]["param_groups"]]
    try:
        manifest = load_checkpoint(state, path)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (--resume: move {path} out of {root} to resume from the checkpoint "
                              f"before it, or start afresh with --overwrite)") from None
    losses = check_resumed(trainer_extra(manifest), path, step, seed)
    for group, names in zip(state["optim"]["param_groups"], own_params):
        group["params"] = names
    set_optimizer_state_dict(model, opt, state["optim"])
    torch.set_rng_state(state["rng"]["torch_cpu"])
    return step, losses


def _load_shards(root: str, path: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 seed: int) -> list[float]:
    """A safetensors-shards checkpoint into the model, the optimizer's moments (in place), its
    step counts and (when saved by torch) the generator; the losses so far."""
    from hp_checkpoint.manifest import read_manifest

    has_rng = "rng.torch_cpu" in read_manifest(path).tensors
    state = _shards_state(model, opt, rng=has_rng)
    manifest = load_train_shards(state, path, root)
    losses = check_resumed(trainer_extra(manifest), path, step, seed)
    adam_step = int(state["adam_step"])
    for s in opt.state.values():
        if isinstance(s.get("step"), torch.Tensor):
            s["step"].fill_(adam_step)
        else:
            s["step"] = adam_step
    if has_rng:
        torch.set_rng_state(state["rng"]["torch_cpu"])
    return losses
