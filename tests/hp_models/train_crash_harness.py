"""Running the trainer's launcher for the crash tests (tiny model, tp=2 on 2 ranks, 6
steps) and reading what a run left behind.

Each run's launcher is a process of its own forked from a server that imported the trainer once
(its ranks fork from a server of its own, as the trainer does), instead of an interpreter per run
re-importing torch and the model.
"""

from __future__ import annotations

import atexit
import functools
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hp_checkpoint.manifest import verify_checkpoint
from hp_dtensor.testing import preload_in_fork_server
from hp_models.trainer.resume import trainer_extra

STEPS = 6
FLAGS = ["--seq-len", "16", "--batch-size", "8", "--lr", "1e-2"]


# Launchers are forked from a server that has only imported the trainer (no thread pool used).
_ctx = mp.get_context("forkserver")
preload_in_fork_server(["torch", "hp_models.train", "hp_models.qwen3_5", "hp_checkpoint.manifest"])


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HP_CHECKPOINT_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if fault is not None:
        env["HP_CHECKPOINT_FAULT"] = fault
    return env


def _argv(out: Path, steps: int, *extra: str) -> list[str]:
    return ["--steps", str(steps), "--out-dir", str(out), *FLAGS, *extra]


def _launcher_main(argv: list[str], env: dict[str, str], err_path: str) -> None:
    """``python -m hp_models.train <argv>`` in this process: its environment, its stderr into a
    file; an uncaught error prints its traceback there and exits 1, as the command does."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    from hp_models import train

    sys.exit(train.main(argv))


class Launcher:
    """A trainer run's launcher process (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.err_path = os.path.join(tempfile.mkdtemp(prefix="hp-launcher-"), "stderr")
        self.proc = _ctx.Process(target=_launcher_main, args=(argv, env, self.err_path))
        self.proc.start()
        assert self.proc.pid is not None
        self.pid: int = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float) -> int:
        self.proc.join(timeout)
        assert self.proc.exitcode is not None, f"the launcher is still running after {timeout} s"
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    @property
    def stderr(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()


def start(out: Path, steps: int, *extra: str, fault: str | None = None) -> Launcher:
    return Launcher(_argv(out, steps, *extra), _env(fault))


def run(out: Path, steps: int, *extra: str, fault: str | None = None) -> Launcher:
    launcher = start(out, steps, *extra, fault=fault)
    launcher.wait(300)
    return launcher


def losses(out: Path) -> list[float]:
    return list(json.loads((out / "log.json").read_text())["losses"])


# A crash test's checkpoint format: the default (safetensors-shards at pp=1), or DCP (the format
# under pipeline parallelism) asked for by flag.
SHARDS: tuple[str, ...] = ()
DCP = ("--checkpoint-format", "dcp")


@functools.cache
def reference_run(fmt: tuple[str, ...] = SHARDS) -> tuple[list[float], Path]:
    """The uninterrupted run in format ``fmt``: 6 steps, a checkpoint after every step, all kept.
    Run once per process and format: the crash test files batched into one pytest process share it."""
    out = Path(tempfile.mkdtemp(prefix="hp-crash-reference-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    done = run(out, STEPS, "--checkpoint-every", "1", "--keep", str(STEPS), *fmt)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(out), out / "checkpoint"


def same_as_reference(path: str, ref_root: Path) -> None:
    """A checkpoint left by a crashed run is, file for file, the uninterrupted run's checkpoint of
    the same step (data files are deterministic at one layout; DCP's ``.metadata`` holds a save
    id), with the same losses: model, optimizer, generator and data position all equal, no mix."""
    got = verify_checkpoint(path)
    want = verify_checkpoint(str(ref_root / os.path.basename(path)))
    assert got.kind == want.kind, path
    data = {k: v for k, v in got.files.items() if k != ".metadata"}
    assert data and data == {k: v for k, v in want.files.items() if k != ".metadata"}, path
    assert trainer_extra(got)["losses"] == trainer_extra(want)["losses"] and got.tensors == want.tensors, path


def resume(out: Path, path: str, step: int, *layout: str, announced: tuple[str, ...] = ()) -> list[float]:
    resumed = run(out, STEPS, "--checkpoint-every", "2", "--resume", *layout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {path} (step {step}" in resumed.stderr, resumed.stderr[-2000:]
    assert all(a in resumed.stderr for a in announced), resumed.stderr[-2000:]
    return losses(out)


def _children(pid: int) -> list[tuple[int, bytes]]:
    """The child processes of ``pid``, with their command lines."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    out = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                out.append((kid, f.read()))
        except FileNotFoundError:
            continue
    return out


def rank_pids(launcher: int) -> list[int]:
    """The launcher's ranks: the children of its fork server (or, spawned, its own children)."""
    out = []
    for pid, cmd in _children(launcher):
        if b"spawn_main" in cmd:
            out.append(pid)
        elif b"multiprocessing.forkserver" in cmd:
            out.extend(kid for kid, _ in _children(pid))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return False


def wait_for(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def saving(root: Path) -> bool:
    """A save is under way (or was cut short): a staging directory exists."""
    return any(n.startswith(".staging-") for n in os.listdir(root))
