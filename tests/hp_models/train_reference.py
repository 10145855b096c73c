"""The one-process reference the trainer tests compare distributed runs with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hp_models import train


def single_process_run(argv: list[str], out: Path) -> dict[str, Any]:
    """The run ``argv`` describes, on one process as ``--compare-single`` trains it (same global
    batch), writing under ``out``; returns the trainer's result (``losses``, ...)."""
    from hp_models.job import single_process

    args = train.parse_args([*argv, "--out-dir", str(out)])
    config, layout = train.check_args(args)
    one = single_process(layout, train.model_sizes(config))
    return train.train(args, one, config, 0, distributed=False, quiet=True)  # type: ignore[no-any-return]


def worst_difference(got: list[float], want: list[float]) -> float:
    """The largest absolute difference of two loss curves of the same length."""
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) for a, b in zip(got, want))
