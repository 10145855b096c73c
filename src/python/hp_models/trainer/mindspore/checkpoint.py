"""The trainer's checkpoint on MindSpore: the model, AdamW's moments and step count, and the
trainer's record, in the safetensors-shards layout the torch trainer writes and reads too
(``hp_models.trainer.shards_checkpoint``).  A resume loads under this run's parallelism whatever
the saving run's was (each rank reads the slices it holds), from a MindSpore or a torch run.

``AdamW`` keeps each moment as a plain tensor of its parameter's local shard; for the checkpoint
it is laid out as the parameter (a DTensor of the parameter's spec over the same data), so the
moments reshard with the parameters.  MindSpore's generator state is not saved: the trainer draws
no random numbers after the initial weights, which come from torch.
"""

from __future__ import annotations

import sys
from typing import Any

from hp_checkpoint.manifest import CheckpointKind
from hp_dtensor.layout.shard_boxes import CheckpointError
from hp_models.trainer.mindspore.optimizer import AdamW
from hp_models.trainer.resume import check_resumed, resume_plan, train_record, trainer_extra
from hp_models.trainer.shards_checkpoint import load_train_shards, save_train_shards, train_state


def _laid_out(moment: Any, param: Any) -> Any:
    """``moment`` (a plain local tensor) as a DTensor laid out like ``param``, or itself for a
    plain parameter."""
    from hp_dtensor.platform import current

    dtensor = current().DTensor
    return dtensor(moment, param._spec) if isinstance(param, dtensor) else moment


def _local(t: Any) -> Any:
    from hp_dtensor.platform import current

    return t.to_local() if isinstance(t, current().DTensor) else t


def _state(model: Any, opt: AdamW) -> tuple[dict[str, Any], list[str]]:
    """The state dict (model tensors in place, the moments over AdamW's own data) and the name of
    each of the optimizer's parameters in its order."""
    from hp_dtensor.platform import current

    params = current().state_dict(model)
    names: dict[int, str] = {}
    for name, p in params.items():
        names.setdefault(id(p), name)
    missing = [tuple(p.shape) for p in opt.params if id(p) not in names]
    if missing:
        raise ValueError(f"checkpoint: the optimizer holds parameters of shapes {missing} the model does not: pass "
                         f"the model the optimizer was built on")
    order = [names[id(p)] for p in opt.params]
    opt.init_state()
    moments = {fqn: {"exp_avg": _laid_out(m, p), "exp_avg_sq": _laid_out(v, p)}
               for fqn, p, m, v in zip(order, opt.params, opt.m, opt.v, strict=True)}
    return train_state(params, moments, opt.t), order


def save_train_state_ms(root: str, model: Any, opt: AdamW, step: int, losses: list[float], *, seed: int,
                        keep: int, layout: dict[str, Any], run: dict[str, Any]) -> str:
    """Save the state after ``step`` optimizer steps as ``<root>/step-<N>``; collective (every
    rank); ``CheckpointError`` on every rank when it fails."""
    state, _ = _state(model, opt)
    return save_train_shards(state, root, step, train_record(step, losses, seed=seed, layout=layout, run=run), keep)


def load_train_state_ms(root: str, model: Any, opt: AdamW, *, seed: int, announce: bool, run: dict[str, Any],
                        layout: dict[str, Any]) -> tuple[int, list[float]]:
    """Load the newest complete checkpoint under ``root`` into ``model`` and ``opt`` (any
    parallelism; written by MindSpore or torch in the safetensors-shards format); returns
    ``(step, losses)``.  ``CheckpointError`` on every rank when there is none, when another run
    saved it, when it is a DCP checkpoint, or when it fails verification."""
    plan = resume_plan(root, run, layout)
    if announce:
        print(plan.announcement(), file=sys.stderr, flush=True)
    if plan.kind != CheckpointKind.SAFETENSORS_SHARDS:
        raise CheckpointError(f"--resume from {plan.path}: a {plan.kind} checkpoint (written by {plan.framework}); "
                              f"the MindSpore backend resumes safetensors-shards checkpoints only: resume it with "
                              f"--backend torch, whose later checkpoints are --checkpoint-format "
                              f"safetensors-shards when pipeline_parallel is 1 (the default there)")
    state, order = _state(model, opt)
    manifest = load_train_shards(state, plan.path, root)
    losses = check_resumed(trainer_extra(manifest), plan.path, plan.step, seed)
    opt.m = [_local(state["optim"][fqn]["exp_avg"]) for fqn in order]
    opt.v = [_local(state["optim"][fqn]["exp_avg_sq"]) for fqn in order]
    opt.t = int(state["adam_step"])
    return plan.step, losses
