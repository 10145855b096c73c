# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr"
"""``python -m hp_models.train --backend mindspore``: the command end to end (the scheduler and 2
mccl worker ranks it starts, the progress bar, ``log.json``, the summary and the checkpoints),
and every feature the MindSpore backend lacks refused before any rank starts with one error
naming it and pointing to the torch backend (``check_args``: the ``NotImplementedError`` of ``check_backend`` as the
command's one ``error:`` line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hp_models.trainer.args import parse_args
from hp_models.trainer.backend import Backend
from hp_models.trainer.checks import check_args

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CP_JOB = os.path.join(ROOT, "examples", "qwen3_5_cp_ulysses.yaml")

# flags -> the feature the refusal names
REFUSED = [
    (["--pp", "2", "--tp", "1", "--nproc", "2"], "pipeline parallelism (pipeline_parallel=2)"),
    (["--job", CP_JOB, "--nproc", "4", "--seq-len", "64"], "context parallelism (context_parallel=4)"),
    (["--job", CP_JOB, "--nproc", "4", "--seq-len", "64"], "packed documents"),
    (["--config", "tiny-moe", "--ep", "2", "--tp", "1", "--nproc", "2"], "the mixture-of-experts model"),
    (["--activation-checkpoint", "full"], "activation checkpointing (full)"),
    (["--mixed-precision", "bf16", "--tp", "1", "--dp-shard", "2"], "mixed precision (param_dtype bfloat16"),
    (["--checkpoint-format", "dcp"], "DCP checkpoints (--checkpoint-format dcp"),
]


@pytest.mark.parametrize(("flags", "feature"), REFUSED, ids=[f for _, f in REFUSED])
def test_refused_before_any_rank_starts(flags, feature, tmp_path) -> None:
    args = parse_args(["--backend", "mindspore", *flags, "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        check_args(args)
    line = str(e.value.code)
    assert line.startswith("error: the MindSpore backend does not support "), line
    assert feature in line and line.endswith("use --backend torch for it"), line


def test_torchrun_launch_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        check_args(parse_args(["--backend", "mindspore", "--out-dir", str(tmp_path)]))
    assert "a torchrun launch (RANK, WORLD_SIZE)" in str(e.value.code)


def test_backend_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "mindspore")
    assert parse_args([]).backend is Backend.MINDSPORE
    assert parse_args(["--backend", "torch"]).backend is Backend.TORCH
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "jax")
    with pytest.raises(SystemExit):  # argparse's error naming the value and the choices
        parse_args([])


def test_the_command_on_two_mindspore_ranks(tmp_path) -> None:
    """tp=2 on 2 ranks for 3 steps, chosen by ``--backend`` alone: exit 0, the progress bar up to step 3, log.json with the
    backend, 3 finite losses, the learning rates and both ranks' peak memory; safetensors-shards checkpoints at steps
    2 and 3 (one file per rank)."""
    out = tmp_path / "run"
    # --backend alone selects MindSpore for the ranks (the launcher may run on either framework)
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_PLATFORM"}
    env["GLOG_v"] = "3"
    proc = subprocess.run(
        [sys.executable, "-m", "hp_models.train", "--backend", "mindspore", "--tp", "2", "--steps", "3",
         "--seq-len", "16", "--batch-size", "2", "--checkpoint-every", "2", "--out-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 3/3  loss " in proc.stderr, proc.stderr[-3000:]
    assert "trained with tp=2 on mindspore" in proc.stdout, proc.stdout
    assert f"checkpoint (safetensors-shards) in {out / 'checkpoint'}" in proc.stdout, proc.stdout
    log = json.loads((out / "log.json").read_text())
    assert log["backend"] == "mindspore" and log["parallelism"]["tp"] == 2 and log["steps"] == 3
    assert len(log["losses"]) == 3 and all(7.0 < x < 7.3 for x in log["losses"]), log["losses"]
    assert log["learning_rates"] == [3e-3] * 3 and len(log["peak_memory_mib_per_rank"]) == 2
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-00000002", "step-00000003"]
    manifest = json.loads((out / "checkpoint" / "step-00000003" / "manifest.json").read_text())
    assert manifest["kind"] == "safetensors-shards" and manifest["framework"] == "mindspore"
    assert sorted(manifest["files"]) == ["shard-rank00000.safetensors", "shard-rank00001.safetensors"]
    assert manifest["extra"]["user"]["losses"] == log["losses"] and manifest["extra"]["values"] == {"adam_step": 3}


_AFTER_A_TORCH_SERVER = """
import multiprocessing.forkserver, os, sys
from hp_models import train
from hp_dtensor.fork_server import add_preload

# As in a process whose torch trainer already ran: its fork server imported the torch trainer,
# which selected torch for every process forked from it.
add_preload(["hp_models.trainer.loop"])
multiprocessing.forkserver.ensure_running()
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_fork_server_that_selected_torch_is_refused(tmp_path) -> None:
    """The MindSpore trainer's ranks fork from the launcher's fork server: one that had selected
    torch would hand them the torch backend; the rank refuses, and the command says why."""
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_PLATFORM"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-c", _AFTER_A_TORCH_SERVER, "--backend", "mindspore", "--nproc", "1", "--tp", "1",
         "--dp-shard", "1", "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "a MindSpore rank forked with the torch backend already selected" in proc.stderr, proc.stderr[-3000:]
