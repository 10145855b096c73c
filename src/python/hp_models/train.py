"""Train Qwen3.5 with tensor parallelism on CPU: ``python -m hp_models.train`` (README's main job).

With no flags: the built-in tiny config on the synthetic next-token task, tp=2 on 2 CPU ranks
spawned here (under ``torchrun`` the launcher's ranks are used instead).  Prints a progress bar,
a summary, writes ``loss.png`` and ``log.json`` to ``--out-dir`` and a checkpoint (HF layout plus
per-rank optimizer state) to ``--checkpoint-dir``; ``--resume`` continues from it with the same
losses.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass
class Args:
    tp: int
    steps: int
    seq_len: int
    batch_size: int
    lr: float
    config: str
    out_dir: str
    checkpoint_dir: str
    checkpoint_every: int
    resume: bool
    seed: int
    compare_single: bool


def parse_args(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(prog="python -m hp_models.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks); default 2")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (total, also when resuming)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--config", default="tiny", help="'tiny' or the path of a HF config.json")
    p.add_argument("--out-dir", default="runs/qwen3_5-tp", help="where loss.png and log.json go")
    p.add_argument("--checkpoint-dir", default=None, help="default: <out-dir>/checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-single", action="store_true", help="also train at tp=1 and report the largest loss gap")
    ns = p.parse_args(argv)
    for name in ("tp", "steps", "seq_len", "batch_size", "checkpoint_every"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.lr <= 0:
        p.error(f"--lr must be > 0, got {ns.lr}")
    return Args(
        tp=ns.tp, steps=ns.steps, seq_len=ns.seq_len, batch_size=ns.batch_size, lr=ns.lr, config=ns.config,
        out_dir=ns.out_dir, checkpoint_dir=ns.checkpoint_dir or os.path.join(ns.out_dir, "checkpoint"),
        checkpoint_every=ns.checkpoint_every, resume=ns.resume, seed=ns.seed, compare_single=ns.compare_single,
    )


def load_config(args: Args) -> Any:
    from hp_models.qwen3_5 import Qwen3_5Config, tiny_config

    if args.config == "tiny":
        return tiny_config()
    return Qwen3_5Config.from_json_file(args.config)


def check_args(args: Args) -> Any:
    """Everything that can be wrong before any rank starts; exits with a message saying what to change."""
    from hp_models.qwen3_5 import check_tp_size

    try:
        config = load_config(args)
        check_tp_size(config, args.tp)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.seq_len % args.tp:
        sys.exit(f"error: --seq-len {args.seq_len} must be divisible by --tp {args.tp} (sequence parallelism)")
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != args.tp:
        sys.exit(f"error: launched with WORLD_SIZE={world} but --tp {args.tp}; launch --tp ranks (torchrun --nproc-per-node {args.tp})")
    if args.resume and not os.path.exists(os.path.join(args.checkpoint_dir, "state.json")):
        sys.exit(f"error: --resume but no checkpoint in {args.checkpoint_dir!r}; run without --resume first")
    return config


# ---------------------------------------------------------------- one rank
def train(args: Args, config: Any, rank: int, world: int, *, distributed: bool, quiet: bool = False) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hp_models import synthetic
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, parallelize_qwen3_5_tp

    torch.manual_seed(args.seed)
    model = config.build()
    model.init_weights()
    adapter = Qwen3_5StateDictAdapter(config)
    mesh = None
    if distributed:
        from hp_dtensor import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_qwen3_5_tp(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, losses = 0, list[float]()
    if args.resume:
        start, losses = _load_checkpoint(args, adapter, model, opt, rank)
    show = rank == 0 and not quiet
    t0 = time.perf_counter()
    tokens = 0
    for step in range(start, args.steps):
        ids, tgt = synthetic.batch(args.seed, step, args.batch_size, args.seq_len, config.vocab_size)
        opt.zero_grad()
        logits = model(ids)
        if distributed:
            from hp_tp import loss_parallel

            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
                loss.backward()
            value = loss.full_tensor().item()  # type: ignore[attr-defined]
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
            loss.backward()
            value = loss.item()
        opt.step()
        losses.append(value)
        tokens += ids.numel()
        if show:
            _progress(step + 1, args.steps, value, tokens / max(time.perf_counter() - t0, 1e-9))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            _save_checkpoint(args, adapter, model, opt, rank, step + 1, losses, distributed)
    if show:
        sys.stderr.write("\n")
    elapsed = time.perf_counter() - t0
    nparams = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "elapsed_s": elapsed, "tokens": tokens, "start_step": start, "nparams": nparams}


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


def _save_checkpoint(args: Args, adapter: Any, model: Any, opt: Any, rank: int, step: int, losses: list[float],
                     distributed: bool) -> None:
    import torch

    path = args.checkpoint_dir
    adapter.save(model, path)  # collective over the ranks for the full tensors; rank 0 writes
    state = {}
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = opt.state.get(p, {})
            state[f"{i}.{j}"] = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()}
    os.makedirs(path, exist_ok=True)
    torch.save(state, os.path.join(path, f"optimizer-rank{rank}.pt"))
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "state.json"), "w") as f:
            json.dump({"step": step, "losses": losses, "tp": args.tp, "seed": args.seed}, f)


def _load_checkpoint(args: Args, adapter: Any, model: Any, opt: Any, rank: int) -> tuple[int, list[float]]:
    import torch

    path = args.checkpoint_dir
    with open(os.path.join(path, "state.json")) as f:
        meta = json.load(f)
    if meta["tp"] != args.tp:
        raise ValueError(f"checkpoint in {path!r} was written at tp={meta['tp']}; resume with --tp {meta['tp']}")
    adapter.load_into(model, path)
    saved = torch.load(os.path.join(path, f"optimizer-rank{rank}.pt"))
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = saved.get(f"{i}.{j}")
            if not st:
                continue
            restored = {}
            for k, v in st.items():
                if hasattr(p, "placements") and v.ndim > 0:
                    from hp_dtensor import DTensor

                    restored[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=tuple(p.shape))
                else:
                    restored[k] = v
            opt.state[p] = restored
    return int(meta["step"]), list(meta["losses"])


# ---------------------------------------------------------------- launching
def _worker(rank: int, world: int, args: Args, store: str, results: Any) -> None:
    try:
        from hp_dtensor.platform import current

        plat = current()
        plat.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        plat.init_rank("gloo", store, rank, world, timeout_s=600)
        out = train(args, load_config(args), rank, world, distributed=True)
        plat.destroy()
        results.put((rank, True, out if rank == 0 else None))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_spawned(args: Args) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="hp-train-")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.tp, args, os.path.join(folder, "store"), results))
             for r in range(args.tp)]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for p in procs:
        p.start()
    out: dict[str, Any] | None = None
    try:
        for _ in procs:
            rank, ok, value = results.get()
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if rank == 0:
                out = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
    assert out is not None
    return out


def write_outputs(args: Args, config: Any, result: dict[str, Any], single: list[float] | None) -> dict[str, Any]:
    os.makedirs(args.out_dir, exist_ok=True)
    losses = result["losses"]
    log = {
        "config": args.config, "tp": args.tp, "steps": args.steps, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "parameters": result["nparams"],
        "losses": losses, "first_loss": losses[0], "final_loss": losses[-1],
        "elapsed_s": result["elapsed_s"], "tokens_per_s": result["tokens"] / max(result["elapsed_s"], 1e-9),
        "resumed_from_step": result["start_step"],
    }
    if single is not None:
        log["single_losses"] = single
        log["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(losses, single))
    with open(os.path.join(args.out_dir, "log.json"), "w") as f:
        json.dump(log, f, indent=2)
    _plot(args, losses, single, config.vocab_size)
    return log


def _plot(args: Args, losses: list[float], single: list[float] | None, vocab: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label=f"tp={args.tp}")
    if single is not None:
        ax.plot(range(1, len(single) + 1), single, "--", label="tp=1")
    ax.axhline(math.log(vocab), color="grey", lw=0.5, ls=":", label="ln(vocab): chance")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Qwen3.5 tiny, synthetic next-token task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "loss.png"), dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = check_args(args)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        from hp_dtensor.platform import current

        current().ensure_process_group("cpu")
        rank = int(os.environ["RANK"])
        result = train(args, config, rank, args.tp, distributed=args.tp > 1)
        if rank != 0:
            return 0
    elif args.tp == 1:
        result = train(args, config, 0, 1, distributed=False)
    else:
        result = run_spawned(args)
    single = None
    if args.compare_single:
        single_args = Args(**{**args.__dict__, "tp": 1, "resume": False,
                              "checkpoint_dir": os.path.join(args.out_dir, "checkpoint-tp1")})
        single = train(single_args, config, 0, 1, distributed=False, quiet=True)["losses"]
        single = single[-len(result["losses"]):]
    log = write_outputs(args, config, result, single)
    print(f"\nQwen3.5 ({args.config}, {log['parameters']:,} parameters) trained with tp={args.tp}")
    first = result["losses"][result["start_step"]]
    print(f"  steps {result['start_step'] + 1}-{args.steps}: loss {first:.4f} -> {log['final_loss']:.4f}")
    print(f"  {log['tokens_per_s']:,.0f} tokens/s, {log['elapsed_s']:.1f} s")
    if single is not None:
        print(f"  largest |loss(tp={args.tp}) - loss(tp=1)| over the run: {log['max_loss_diff_vs_single']:.2e}")
    print(f"  wrote {os.path.join(args.out_dir, 'loss.png')}, {os.path.join(args.out_dir, 'log.json')}, "
          f"checkpoint in {args.checkpoint_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
