"""The README's main job on MindSpore, measured in one run against two baselines:

1. one-process MindSpore: the same model, data and steps on one rank (what tensor parallelism
   must not be much slower than on the same cores);
2. our torch path: the same job at the same parallelism on gloo ranks (the trainer's
   ``--backend torch``), and torch on one process.

Each configuration is the trainer's own command (``python -m hp_models.train``, the tiny
Qwen3.5, batch 8 x 64 tokens) run for ``STEPS`` steps in a process of its own; its per-step
tokens/s come from the run's ``log.json``.  A configuration's figure is the median over its steps
after the first ``WARMUP`` and over ``ROUNDS`` rounds; the configurations run in turn within each
round, so load from other processes hits them alike.  Printed: step time (ms), tokens/s, and the
ratios of each row's step time to its framework's one-process run and to the torch row of the same
layout.  Every run's losses are checked against the one-process torch run first (the two
frameworks train the same weights on the same data), so a fast wrong run cannot pass.

Run: ./pants run benchmarks/ms_train.py   (or HYPER_PARALLEL_PLATFORM=mindspore python benchmarks/ms_train.py)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

STEPS = 8
WARMUP = 2
ROUNDS = 2
LOSS_RTOL = 1e-3  # fp32 on two frameworks and layouts: agreement to float rounding, far below a bug


@dataclass(frozen=True)
class Config:
    name: str
    backend: str
    layout: tuple[str, ...]  # the trainer's parallelism flags
    key: str  # layouts with the same key are compared across frameworks


CONFIGS = (
    Config("MindSpore, one process", "mindspore", ("--nproc", "1", "--tp", "1"), "one"),
    Config("MindSpore tp=2, 2 mccl ranks", "mindspore", ("--nproc", "2", "--tp", "2"), "tp2"),
    Config("MindSpore dp_shard=2, 2 mccl ranks", "mindspore", ("--nproc", "2", "--tp", "1", "--dp-shard", "2"),
           "fsdp2"),
    Config("torch, one process", "torch", ("--nproc", "1", "--tp", "1"), "one"),
    Config("torch tp=2, 2 gloo ranks", "torch", ("--nproc", "2", "--tp", "2"), "tp2"),
    Config("torch dp_shard=2, 2 gloo ranks", "torch", ("--nproc", "2", "--tp", "1", "--dp-shard", "2"), "fsdp2"),
)


def _run(config: Config, out: str) -> dict[str, list[float]]:
    """One trainer run: its per-step tokens/s, its losses, and (one value) its tokens a step."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "GLOG_v": "3"}
    env.pop("HYPER_PARALLEL_PLATFORM", None)  # --backend decides
    cmd = [sys.executable, "-m", "hp_models.train", "--backend", config.backend, *config.layout,
           "--steps", str(STEPS), "--out-dir", out]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{config.name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "log.json")) as f:
        log = json.load(f)
    return {"tok_s": [float(x) for x in log["step_tokens_per_s"]], "losses": [float(x) for x in log["losses"]],
            "tokens": [float(log["batch_size"] * log["seq_len"])]}


def main() -> None:
    per: dict[str, list[float]] = {c.name: [] for c in CONFIGS}
    losses: dict[str, list[float]] = {}
    tokens = 0.0
    with tempfile.TemporaryDirectory(prefix="hp-ms-train-") as root:
        for r in range(ROUNDS):
            for i, c in enumerate(CONFIGS):
                got = _run(c, os.path.join(root, f"r{r}-c{i}"))
                per[c.name] += got["tok_s"][WARMUP:]
                losses[c.name] = got["losses"]
                tokens = got["tokens"][0]
    ref = losses["torch, one process"]
    agree = 0.0
    for name, curve in losses.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, ref))
        if len(curve) != len(ref) or worst > LOSS_RTOL:
            raise AssertionError(f"{name}: losses {curve} differ from one-process torch {ref} (worst {worst:.2e})")
        agree = max(agree, worst)
    ms_step = {c.name: 1e3 * tokens / statistics.median(per[c.name]) for c in CONFIGS}
    by_key = {(c.backend, c.key): ms_step[c.name] for c in CONFIGS}
    print(f"# ms_train: the main job (tiny Qwen3.5, {int(tokens)} tokens a step), {STEPS} steps, median over steps "
          f"{WARMUP + 1}-{STEPS} of {ROUNDS} rounds, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    print(f"# every run's {STEPS} losses equal one-process torch's: worst relative difference {agree:.1e}")
    print("# '/ one process': step time over the same framework's one-process run; '/ torch': over the torch run "
          "of the same layout")
    print(f"{'setup':<38}{'ms/step':>10}{'tok/s':>9}{'/ one process':>15}{'/ torch':>9}")
    for c in CONFIGS:
        step = ms_step[c.name]
        print(f"{c.name:<38}{step:>10.1f}{tokens / step * 1e3:>9.0f}{step / by_key[(c.backend, 'one')]:>15.2f}"
              f"{step / by_key[('torch', c.key)]:>9.2f}")


if __name__ == "__main__":
    main()
