"""Which checkpoint ``--resume`` continues, and whether it belongs to this run: framework-neutral
(no torch, no MindSpore), so both backends and the checks before any rank starts share it.

A resume continues only the run that saved the checkpoint: ``resume_plan`` compares the saved
run's settings (``run_settings``) with this run's and refuses naming each one that differs; a
different layout (tp, dp_shard, replicas, micro-batches) or framework is allowed and announced,
the state reshards on load.  The trainer's own record (step, data position, seed, losses, layout,
run settings) is the manifest's ``extra`` in a DCP checkpoint and ``extra["user"]`` in a
safetensors-shards one (``trainer_extra``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hp_checkpoint.manifest import CheckpointKind, Manifest, SkippedStep, read_manifest, scan_checkpoints
from hp_dtensor.layout.shard_boxes import CheckpointError

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


def trainer_extra(manifest: Manifest) -> dict[str, Any]:
    """The trainer's record in a checkpoint's manifest (``extra``, or a safetensors-shards
    checkpoint's ``extra["user"]``, where ``save_shards`` keeps the caller's)."""
    extra = manifest.extra
    if manifest.kind is CheckpointKind.SAFETENSORS_SHARDS:
        user = extra.get("user")
        return dict(user) if isinstance(user, dict) else {}
    return dict(extra)


@dataclass(frozen=True)
class ResumePlan:
    """What ``--resume`` continues: the newest complete checkpoint (its format and the framework
    that wrote it), the newer step directories it skipped (with why), and how this run's layout
    differs from the one that saved."""

    step: int
    path: str
    skipped: list[SkippedStep] = field(default_factory=list)
    layout_changes: list[str] = field(default_factory=list)
    saved_layout: dict[str, Any] = field(default_factory=dict)
    kind: CheckpointKind = CheckpointKind.DCP
    framework: str = "torch"

    def announcement(self) -> str:
        lines = [f"skipped {s.path} (newer, not a complete checkpoint): {s.reason}" for s in self.skipped]
        saved = self.saved_layout
        lines.append(f"resuming from {self.path} (step {self.step}, {self.kind} written by {self.framework}, saved "
                     f"with dp_replicate={saved.get('dp_replicate')} dp_shard={saved.get('dp_shard')} "
                     f"tp={saved.get('tp')})")
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
    manifest = read_manifest(path)
    extra = trainer_extra(manifest)
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
                      layout_changes=changes, saved_layout=dict(saved_layout), kind=manifest.kind,
                      framework=str(manifest.framework))


def check_resumed(extra: dict[str, Any], path: str, step: int, seed: int) -> list[float]:
    """The losses so far, after checking that the loaded checkpoint's record continues this run's
    data: its seed is this run's and its data position its step (``CheckpointError`` otherwise)."""
    if extra.get("seed") != seed:
        raise CheckpointError(
            f"--resume: checkpoint {path} was trained with --seed {extra.get('seed')}, this run has --seed {seed}; "
            f"the data would not continue: pass --seed {extra.get('seed')}"
        )
    if extra.get("data_position") != step:
        raise CheckpointError(f"checkpoint {path}: data position {extra.get('data_position')} is not its step {step}")
    return [float(x) for x in extra["losses"]]


def train_record(step: int, losses: list[float], *, seed: int, layout: dict[str, Any],
                 run: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint of the trainer records besides the tensors (``check_resumed`` reads it)."""
    return {"step": step, "data_position": step, "seed": seed, "losses": list(losses), "layout": layout,
            "run": run if run is not None else {"seed": seed}}
