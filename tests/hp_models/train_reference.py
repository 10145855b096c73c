"""The one-process reference the trainer tests compare distributed runs with."""

from __future__ import annotations

from collections.abc import Callable
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


def plain_torch_run(steps: int, batch: int, seq_len: int, lr_at: Callable[[int], float],
                    max_norm: float | None, seed: int = 0,
                    betas: tuple[float, float] = (0.9, 0.999)) -> dict[str, Any]:
    """Plain torch on one process, written independently of the trainer: the tiny model as the
    trainer seeds it, AdamW with the learning rate ``lr_at(step)`` of each step, the mean loss over
    each whole synthetic batch, and ``torch.nn.utils.clip_grad_norm_`` to ``max_norm`` (None: the
    norm measured, nothing clipped).  Returns the losses, the norms before clipping, the first
    step's gradients after clipping and the final parameters, by name."""
    import torch
    import torch.nn.functional as F

    from hp_models import synthetic
    from hp_models.qwen3_5 import tiny_config

    cfg = tiny_config()
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), betas=betas, weight_decay=0.0)
    losses, norms, first_grads = [], [], {}
    for step in range(steps):
        ids, tgt = synthetic.batch(seed, step, batch, seq_len, cfg.vocab_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm is not None else float("inf"))
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        losses.append(loss.item())
        norms.append(float(norm))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "first_grads": first_grads, "params": params}
