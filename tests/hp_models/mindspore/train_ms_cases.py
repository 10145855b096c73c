# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr"
"""The runs the MindSpore trainer test compares: the torch trainer on one process (which also
writes its initial weights for the MindSpore ranks), and the MindSpore trainer
(``hp_models.trainer.mindspore``) on the ranks of a pool or on one process."""

from __future__ import annotations

import os
from typing import Any

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


def ms_run(rank: int, world: int, args: Args, layout: TrainLayout, weights: str, *, single: bool = False):
    """On each MindSpore rank: the MindSpore trainer over the pool's ranks, or (``single``) on rank
    0 alone as one process (the other ranks return None)."""
    from hp_models.trainer.mindspore.loop import train_ms

    if single and rank != 0:
        return None
    assert os.environ.get("HYPER_PARALLEL_PLATFORM") == "mindspore"
    return train_ms(args, layout, load_config(args), rank, weights, distributed=not single, quiet=True)
