"""The trainer's checkpoint: everything a resumed run needs to continue the loss curve exactly.

Saved through ``hp_checkpoint.atomic`` (sharded, atomic, verified):

- ``model``: the parameters as the model holds them (DTensors: each rank writes its shards);
- ``optim``: AdamW's state keyed by parameter name, so it reshards with the parameters when the
  run resumes under another parallelism;
- ``rng.torch_cpu``: the default CPU generator's state.  Random ops on DTensors draw from that
  generator on every rank alike (the RNG tracker keeps no other state), so one copy serves every
  rank and every layout; a save checks that the ranks agree;
- in the manifest's ``extra``: the step, the data position (the index of the next synthetic
  batch), the seed, the losses so far and the layout that saved it.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch

from hp_checkpoint.atomic import latest_checkpoint, load_checkpoint, save_checkpoint
from hp_checkpoint.dcp import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from hp_dtensor.layout.shard_boxes import CheckpointError
from hp_dtensor.platform.torch.collectives import all_gather_object


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


def save_train_state(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                     losses: list[float], *, seed: int, keep: int, layout: dict[str, Any]) -> str:
    """Save the state after ``step`` optimizer steps as ``<root>/step-<N>``; collective."""
    _check_rng_agrees()
    extra = {"step": step, "data_position": step, "seed": seed, "losses": list(losses), "layout": layout}
    return save_checkpoint(_state(model, opt), root, step, extra=extra, keep=keep)


def load_train_state(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer, *, seed: int,
                     announce: bool) -> tuple[int, list[float]]:
    """Load the newest complete checkpoint under ``root`` into ``model``/``opt`` and the generator
    (any parallelism); returns ``(step, losses)``.  Raises ``CheckpointError`` on every rank when
    there is none, or it fails verification (naming the file or tensor)."""
    found = latest_checkpoint(root)
    if found is None:
        raise CheckpointError(f"--resume: no complete checkpoint (step-<N>/ with a manifest) in {root!r}")
    step, path = found
    state = _state(model, opt)
    manifest = load_checkpoint(state, path)
    extra = manifest.extra
    if extra.get("seed") != seed:
        raise CheckpointError(
            f"--resume: checkpoint {path} was trained with --seed {extra.get('seed')}, this run has --seed {seed}; "
            f"the data would not continue: pass --seed {extra.get('seed')}"
        )
    if extra.get("data_position") != step:
        raise CheckpointError(f"checkpoint {path}: data position {extra.get('data_position')} is not its step {step}")
    set_optimizer_state_dict(model, opt, state["optim"])
    torch.set_rng_state(state["rng"]["torch_cpu"])
    if announce:
        saved = extra.get("layout", {})
        print(f"resuming from {path} (step {step}, saved with dp_replicate={saved.get('dp_replicate')} "
              f"dp_shard={saved.get('dp_shard')} tp={saved.get('tp')})", file=sys.stderr, flush=True)
    return step, [float(x) for x in extra["losses"]]
