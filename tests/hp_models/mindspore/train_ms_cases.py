# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""The runs the MindSpore trainer tests compare: the torch trainer on one process or on the gloo
ranks of a pool (which also writes its initial weights for the MindSpore ranks), and the
MindSpore trainer (``hp_models.trainer.mindspore``) on the ranks of a pool or in one process of
its own; and the comparison itself (``check_equals_one_process_and_torch``), one job per test
file."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hp_models.job import TrainLayout, plan
from hp_models.trainer.args import Args, parse_args
from hp_models.trainer.checks import load_config, model_sizes, overrides


def job(flags: list[str], world: int, out_dir: str) -> tuple[Args, TrainLayout]:
    """The command line ``flags`` (the tiny model, no event files) and its layout on ``world`` ranks."""
    args = parse_args([*flags, "--out-dir", out_dir])
    return args, plan(None, overrides(args), model_sizes(load_config(args)), world)


def torch_single(rank: int, world: int, args: Args, layout: TrainLayout, weights: str) -> dict[str, Any]:
    """On a torch rank: the torch trainer's run on one process (its losses, gradient norms and
    learning rates), and its initial weights written to ``weights`` for the MindSpore runs."""
    from hp_models.trainer.loop import train
    from hp_models.trainer.mindspore.weights import write_torch_initial_state

    config = load_config(args)
    write_torch_initial_state(config, args.seed, weights)
    return train(args, layout, config, 0, distributed=False, quiet=True)


def torch_ranks(rank: int, world: int, args: Args, layout: TrainLayout, weights: str | None = None) -> dict[str, Any]:
    """On each torch rank of a pool: the torch trainer over the pool's gloo ranks (checkpoints as
    ``args`` say); with ``weights``, rank 0 first writes the initial weights for MindSpore runs."""
    from hp_models.trainer.loop import train
    from hp_models.trainer.mindspore.weights import write_torch_initial_state

    config = load_config(args)
    if weights is not None and rank == 0:
        write_torch_initial_state(config, args.seed, weights)
    return train(args, layout, config, rank, distributed=world > 1, quiet=True)


def ms_run(rank: int, world: int, args: Args, layout: TrainLayout, weights: str):
    """On each MindSpore rank: the MindSpore trainer over the pool's ranks.  (One MindSpore
    process runs in a process of its own, ``run_spawned_ms``: its checkpoint's collectives span
    the whole world.)"""
    from hp_models.trainer.mindspore.loop import train_ms

    assert os.environ.get("HYPER_PARALLEL_PLATFORM") == "mindspore"
    return train_ms(args, layout, load_config(args), rank, weights, distributed=True, quiet=True)


TOL = {"rtol": 1.5e-4, "atol": 1e-5}


def _worst_rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


def check_equals_one_process_and_torch(ms_pool: Any, torch_pool: Any, name: str, flags: list[str], steps: int,
                                       tmp_path: Any) -> None:
    """The MindSpore trainer on the 4 ranks of ``ms_pool`` with ``flags`` equals one MindSpore
    process and the torch trainer on one process, from the same initial weights on the same data:
    every rank's losses and gradient norms the same, the losses, gradient norms, learning rates
    and parameter counts those of the references."""
    args, layout = job(["--backend", "mindspore", *flags], 4, str(tmp_path / "ms"))
    single_args, single = job(["--backend", "mindspore", *flags, "--nproc", "1", "--tp", "1", "--dp-shard", "1"], 1,
                              str(tmp_path / "ms-single"))
    torch_args, _ = job([*flags, "--nproc", "1", "--tp", "1", "--dp-shard", "1", "--backend", "torch",
                         "--checkpoint-every", "100"], 1, str(tmp_path / "torch"))
    assert layout.world_size == 4 and single.world_size == 1
    weights = str(tmp_path / "initial.npz")
    (ref,) = torch_pool.run(torch_single, torch_args, single, weights)
    runs = ms_pool.run(ms_run, args, layout, weights)
    # one MindSpore process of its own (world 1): the run saves a checkpoint at its end, whose
    # collectives would span every rank of the pool
    from hp_models.trainer.mindspore.spawn import run_spawned_ms

    one = run_spawned_ms(single_args, single, load_config(single_args), quiet=True)
    ours = runs[0]
    for r in runs[1:]:
        assert r["losses"] == ours["losses"] and r["grad_norms"] == ours["grad_norms"]  # every rank's figures
    assert len(ours["losses"]) == len(one["losses"]) == len(ref["losses"]) == steps
    np.testing.assert_allclose(ours["losses"], one["losses"], err_msg="4 ranks vs one MindSpore process", **TOL)
    np.testing.assert_allclose(ours["losses"], ref["losses"], err_msg="MindSpore vs the torch trainer", **TOL)
    np.testing.assert_allclose(one["losses"], ref["losses"], err_msg="one MindSpore process vs torch", **TOL)
    np.testing.assert_allclose(ours["grad_norms"], ref["grad_norms"], err_msg="gradient norms", **TOL)
    assert ours["learning_rates"] == ref["learning_rates"]
    assert ours["nparams"] == one["nparams"] == ref["nparams"]
    assert len(ours["peak_memory_mib_per_rank"]) == 4
    print(f"{name} ({layout.describe()}): {steps} steps, worst loss rel diff vs 1 process "
          f"{_worst_rel(ours['losses'], one['losses']):.1e}, vs torch {_worst_rel(ours['losses'], ref['losses']):.1e}; "
          f"grad norms vs torch {_worst_rel(ours['grad_norms'], ref['grad_norms']):.1e}; losses {ours['losses']}")
