"""The trainer's checkpoint: everything a resumed run needs to continue the loss curve exactly.

Saved through ``hp_checkpoint.atomic`` (sharded, atomic, verified):

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

``--resume`` continues only the run that saved the checkpoint: ``resume_plan`` compares the saved
run's settings with this run's and refuses naming each one that differs; a different layout
(tp, dp_shard, replicas, micro-batches) is allowed and announced, the state reshards on load.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_checkpoint.atomic import load_checkpoint, save_checkpoint
from hp_checkpoint.dcp import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from hp_checkpoint.manifest import SkippedStep, read_manifest, scan_checkpoints
from hp_dtensor.layout.shard_boxes import CheckpointError
from hp_dtensor.platform.torch.collectives import all_gather_object

# Settings that make a run: a checkpoint continues only a run with the same ones.  (The layout,
# the number of steps and the checkpoint cadence may change between a save and a resume.)
RUN_KEYS = ("seed", "lr", "seq_len", "global_batch_size", "optimizer", "weight_decay", "model", "lr_schedule",
            "max_grad_norm", "adam_betas", "adam_eps")


def run_settings(*, seed: int, lr: float, seq_len: int, global_batch_size: int, model: dict[str, Any],
                 optimizer: str = "AdamW", weight_decay: float = 0.0, lr_schedule: dict[str, Any] | None = None,
                 max_grad_norm: float | None = None, adam_betas: tuple[float, float] = (0.9, 0.999),
                 adam_eps: float = 1e-8) -> dict[str, Any]:
    """The settings a resumed run must share with the run that saved (as JSON keeps them).
    ``lr_schedule`` (a schedule other than a constant rate), ``max_grad_norm`` and AdamW's betas
    and eps other than torch's defaults are recorded only when given, so runs without them keep
    the settings they had."""
    run: dict[str, Any] = {"seed": seed, "lr": lr, "seq_len": seq_len, "global_batch_size": global_batch_size,
                           "optimizer": optimizer, "weight_decay": weight_decay, "model": model}
    if lr_schedule is not None:
        run["lr_schedule"] = lr_schedule
    if max_grad_norm is not None:
        run["max_grad_norm"] = max_grad_norm
    if tuple(adam_betas) != (0.9, 0.999):
        run["adam_betas"] = list(adam_betas)
    if adam_eps != 1e-8:
        run["adam_eps"] = adam_eps
    return json.loads(json.dumps(run))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ResumePlan:
    """What ``--resume`` continues: the newest complete checkpoint, the newer step directories it
    skipped (with why), and how this run's layout differs from the one that saved."""

    step: int
    path: str
    skipped: list[SkippedStep] = field(default_factory=list)
    layout_changes: list[str] = field(default_factory=list)
    saved_layout: dict[str, Any] = field(default_factory=dict)

    def announcement(self) -> str:
        lines = [f"skipped {s.path} (newer, not a complete checkpoint): {s.reason}" for s in self.skipped]
        saved = self.saved_layout
        lines.append(f"resuming from {self.path} (step {self.step}, saved with dp_replicate="
                     f"{saved.get('dp_replicate')} dp_shard={saved.get('dp_shard')} tp={saved.get('tp')})")
        if self.layout_changes:
            lines.append(f"layout changed since the save: {', '.join(self.layout_changes)}; the model and "
                         f"optimizer state reshard on load")
        return "\n".join(lines)


def _differences(saved: Any, here: Any, prefix: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(here, dict):
        out = []
        for key in sorted(set(saved) | set(here)):
            out += _differences(saved.get(key), here.get(key), f"{prefix}.{key}")
        return out
    return [] if saved == here else [f"{prefix.lstrip('.')} {saved!r} (this run: {here!r})"]


def resume_plan(root: str, run: dict[str, Any], layout: dict[str, Any]) -> ResumePlan:
    """The checkpoint ``--resume`` continues, read from its manifest (no collective; the same on
    every rank).  Raises ``CheckpointError`` when there is none, or when it was saved by a run with
    other settings (``run_settings``), naming each differing one."""
    complete, skipped = scan_checkpoints(root)
    if not complete:
        why = "".join(f"; {s.path}: {s.reason}" for s in skipped)
        raise CheckpointError(f"--resume: no complete checkpoint (step-<N>/ with a manifest) in {root!r}{why}; "
                              f"run without --resume first")
    step, path = complete[-1]
    extra = read_manifest(path).extra
    saved_run = extra.get("run")
    if not isinstance(saved_run, dict):
        saved_run = {"seed": extra.get("seed")}  # saved before runs recorded their settings: the seed only
        run = {"seed": run["seed"]}
    differ = [d for key in RUN_KEYS if key in saved_run or key in run
              for d in _differences(saved_run.get(key), run.get(key), key)]
    if differ:
        raise CheckpointError(
            f"--resume: the newest checkpoint {path} was saved by another run: {'; '.join(differ)}. Pass the "
            f"same settings to continue it, or start a new run with --overwrite (deletes its checkpoints) or "
            f"another --checkpoint-dir"
        )
    raw_layout = extra.get("layout")
    saved_layout: dict[str, Any] = raw_layout if isinstance(raw_layout, dict) else {}
    changes = [f"{k} {saved_layout.get(k)} -> {layout.get(k)}" for k in sorted(set(saved_layout) | set(layout))
               if k != "global_batch_size" and saved_layout.get(k) != layout.get(k)]
    return ResumePlan(step=step, path=path, skipped=[s for s in skipped if s.step > step],
                      layout_changes=changes, saved_layout=dict(saved_layout))


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
                     losses: list[float], *, seed: int, keep: int, layout: dict[str, Any],
                     run: dict[str, Any] | None = None) -> str:
    """Save the state after ``step`` optimizer steps as ``<root>/step-<N>``; collective.  ``run``:
    the run's settings (``run_settings``), which a resume must match."""
    _check_rng_agrees()
    extra = {"step": step, "data_position": step, "seed": seed, "losses": list(losses), "layout": layout,
             "run": run if run is not None else {"seed": seed}}
    return save_checkpoint(_state(model, opt), root, step, extra=extra, keep=keep)


def load_train_state(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer, *, seed: int,
                     announce: bool, run: dict[str, Any] | None = None,
                     layout: dict[str, Any] | None = None) -> tuple[int, list[float]]:
    """Load the newest complete checkpoint under ``root`` into ``model``/``opt`` and the generator
    (any parallelism); returns ``(step, losses)``.  Raises ``CheckpointError`` on every rank when
    there is none, when it was saved by a run with other settings, or when it fails verification
    (naming the file or tensor).  ``announce``: print which checkpoint, the newer step directories
    skipped and why, and the layout changes."""
    plan = resume_plan(root, run if run is not None else {"seed": seed}, layout or {})
    step, path = plan.step, plan.path
    if announce:
        print(plan.announcement(), file=sys.stderr, flush=True)
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
    extra = manifest.extra
    if extra.get("seed") != seed:
        raise CheckpointError(
            f"--resume: checkpoint {path} was trained with --seed {extra.get('seed')}, this run has --seed {seed}; "
            f"the data would not continue: pass --seed {extra.get('seed')}"
        )
    if extra.get("data_position") != step:
        raise CheckpointError(f"checkpoint {path}: data position {extra.get('data_position')} is not its step {step}")
    for group, names in zip(state["optim"]["param_groups"], own_params):
        group["params"] = names
    set_optimizer_state_dict(model, opt, state["optim"])
    torch.set_rng_state(state["rng"]["torch_cpu"])
    return step, [float(x) for x in extra["losses"]]
