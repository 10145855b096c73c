"""The trainer's state as a safetensors-shards checkpoint: the format both backends write and
read, so a run saved on torch resumes on MindSpore and back, under any parallelism.

The state dict has the same names on both frameworks (the two Qwen3.5 models share their
parameter names):

- ``model.<fqn>``: every parameter and buffer as the model holds it (a DTensor: each rank writes
  the boxes it holds);
- ``optim.<fqn>.exp_avg`` and ``optim.<fqn>.exp_avg_sq``: AdamW's moments of each trained
  parameter, laid out as the parameter, so they reshard with it;
- ``adam_step``: AdamW's step count (a number: the same for every parameter);
- ``rng.torch_cpu``: written by torch only (its CPU generator's state); a torch run loads it when
  the checkpoint has it, MindSpore has no use for it;
- the manifest's ``extra["user"]``: the trainer's record (``resume.train_record``).

Framework-neutral: the tensors come from the backend (``hp_models.train_checkpoint`` on torch,
``hp_models.trainer.mindspore.checkpoint``); saving, pruning to ``--keep`` and loading are
``hp_checkpoint.safetensors_shards``' collectives, whose errors every rank raises alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_checkpoint.gather_to_rank import transfer_primitives
from hp_checkpoint.manifest import Manifest, describe_os_error, prune
from hp_checkpoint.safetensors_shards import load_shards, save_shards
from hp_dtensor.layout.shard_boxes import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")


def train_state(model: Mapping[str, Any], moments: Mapping[str, Mapping[str, Any]], adam_step: int,
                rng: Any = None) -> dict[str, Any]:
    """The state dict of the layout above from the backend's tensors: ``model`` (name -> tensor),
    ``moments`` (parameter name -> ``{"exp_avg": ..., "exp_avg_sq": ...}``), the step count and
    torch's generator state (None: none)."""
    state: dict[str, Any] = {"model": dict(model), "optim": {k: dict(v) for k, v in moments.items()},
                             "adam_step": int(adam_step)}
    if rng is not None:
        state["rng"] = {"torch_cpu": rng}
    return state


def save_train_shards(state: Mapping[str, Any], root: str, step: int, record: Mapping[str, Any], keep: int) -> str:
    """Save ``state`` (``train_state``'s) as ``<root>/step-<N>`` with the trainer's ``record``,
    then prune to the newest ``keep`` complete checkpoints; collective.  Returns the path;
    ``CheckpointError`` on every rank when the save or the pruning failed."""
    path = save_shards(state, root, step, extra=record)
    prims = transfer_primitives()
    error = None
    if prims.rank() == 0:
        try:
            prune(root, keep)
        except OSError as e:
            error = describe_os_error(e, f"checkpoint of step {step} saved, but pruning {root} to the newest {keep} "
                                         f"failed")
    errors = [e for e in prims.all_gather_object(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    return path


def load_train_shards(state: dict[str, Any], path: str, root: str) -> Manifest:
    """Load the checkpoint at ``path`` into ``state`` (``train_state``'s, this run's layout: each
    rank reads its slices); collective.  The step count comes back in ``state["adam_step"]``.
    A damaged or mismatching checkpoint raises ``CheckpointError`` on every rank, saying how to
    resume from the one before."""
    try:
        return load_shards(state, path)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (--resume: move {path} out of {root} to resume from the checkpoint "
                              f"before it, or start afresh with --overwrite)") from None
