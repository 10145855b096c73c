"""What a finished run leaves: ``log.json`` and ``loss.png`` in ``--out-dir`` (the event files are
``metrics``'), and the summary printed at the end."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hp_models.job import TrainLayout
from hp_models.trainer.args import Args
from hp_models.trainer.backend import Backend

# the per-step metrics and settings ``log.json`` carries from the run's result
_METRICS = ("learning_rates", "grad_norms", "step_tokens_per_s", "peak_memory_mib_per_rank", "lr_schedule",
            "max_grad_norm", "tensorboard_dir")


def write_outputs(args: Args, layout: TrainLayout, config: Any, result: dict[str, Any],
                  single: list[float] | None) -> dict[str, Any]:
    os.makedirs(args.out_dir, exist_ok=True)
    losses = result["losses"]
    log = {
        "config": args.config, "job": args.job, "tp": layout.tp, "steps": args.steps, "seq_len": args.seq_len,
        "batch_size": layout.global_batch_size, "parallelism": layout.as_dict(), "lr": layout.optim.lr, "seed": args.seed,
        "parameters": result["nparams"], "losses": losses, "first_loss": losses[0], "final_loss": losses[-1],
        "elapsed_s": result["elapsed_s"], "tokens_per_s": result["tokens"] / max(result["elapsed_s"], 1e-9),
        "resumed_from_step": result["start_step"], "backend": args.backend.value,
        "adamw": {"betas": list(layout.optim.betas), "eps": layout.optim.eps, "weight_decay": layout.optim.weight_decay},
    }
    if "tokens_per_expert" in result:
        log["tokens_per_expert"] = result["tokens_per_expert"]
    if single is not None:
        log["single_losses"] = single
        log["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(losses, single))
        log["max_loss_rel_diff_vs_single"] = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
    log.update({k: result[k] for k in _METRICS if k in result})
    with open(os.path.join(args.out_dir, "log.json"), "w") as f:
        json.dump(log, f, indent=2)
    _plot(args, layout, losses, single, config.vocab_size)
    return log


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plot(args: Args, layout: TrainLayout, losses: list[float], single: list[float] | None, vocab: int) -> None:
    if not _has_matplotlib():  # (a MindSpore environment may lack it; the summary says so)
        return
    # (not inferred: the MindSpore resolve has no matplotlib; the torch targets name it in BUILD)
    import matplotlib  # pants: no-infer-dep

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pants: no-infer-dep

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


def print_summary(args: Args, layout: TrainLayout, result: dict[str, Any], log: dict[str, Any],
                  single: list[float] | None) -> None:
    on = "" if args.backend is Backend.TORCH else f" on {args.backend.value}"
    print(f"\nQwen3.5 ({args.config}, {log['parameters']:,} parameters) trained with {layout.describe()}{on}")
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
    tb = result.get("tensorboard_dir")
    saved = f"checkpoint ({args.save_format(layout.pp)}) in {args.checkpoint_dir}"
    plot = (f"{os.path.join(args.out_dir, 'loss.png')}, " if _has_matplotlib()
            else "no loss.png (this Python has no matplotlib: pip install matplotlib), ")
    print(f"  wrote {plot}{os.path.join(args.out_dir, 'log.json')}, "
          f"{f'TensorBoard events in {tb}, ' if tb else ''}{saved}")
