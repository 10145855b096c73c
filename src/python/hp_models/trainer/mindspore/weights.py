"""The initial weights of a MindSpore run: those the torch trainer starts from for the same seed.

The torch trainer seeds torch's generator and runs the torch model's ``init_weights``; MindSpore's
generator draws other numbers, so the MindSpore model takes the torch model's initial state dict
(the two models share their parameter names) and both backends train the same model.  The torch
model is a protocol Module of the platform a process selected, so it is built in a short-lived
torch process (``initial_state_file``), which writes the weights to a ``.npz`` file the MindSpore
ranks read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import numpy as np

_PLATFORM = "HYPER_PARALLEL_PLATFORM"


def write_torch_initial_state(config: Any, seed: int, path: str) -> None:
    """On a torch process: the torch trainer's initial parameters for ``seed`` to ``path``."""
    import torch

    torch.manual_seed(seed)
    model = config.build()
    model.init_weights()
    state = {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()}
    np.savez(path, **state)


def initial_state_file(config: Any, seed: int, folder: str) -> str:
    """The path of a ``.npz`` in ``folder`` holding the torch trainer's initial weights for
    ``seed``, written by a torch process started for it; ``RuntimeError`` when that process fails."""
    path = os.path.join(folder, f"initial-{seed}.npz")
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=write_torch_initial_state, args=(config, seed, path))
    before = os.environ.get(_PLATFORM)
    os.environ[_PLATFORM] = "torch"  # a spawned process starts with this environment
    try:
        proc.start()
    finally:
        if before is None:
            del os.environ[_PLATFORM]
        else:
            os.environ[_PLATFORM] = before
    proc.join()
    if proc.exitcode != 0 or not os.path.exists(path):
        raise RuntimeError(f"the torch process building the initial weights exited with code {proc.exitcode}")
    return path


def read_initial_state(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def set_initial_weights(model: Any, state: dict[str, np.ndarray]) -> None:
    """Copy ``state`` into the (not yet parallelized) MindSpore ``model``; ``KeyError`` naming the
    parameters either side lacks, ``ValueError`` naming a shape that differs.  A tied
    ``lm_head.weight`` is the embedding and is set through it."""
    from mindspore import Tensor

    from hp_dtensor.platform import current

    params = current().state_dict(model)
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or extra:
        raise KeyError(f"the torch and MindSpore models differ: MindSpore-only {missing}, torch-only {extra}")
    for name, p in params.items():
        if tuple(p.shape) != state[name].shape:
            raise ValueError(f"{name}: the torch model has shape {state[name].shape}, MindSpore {tuple(p.shape)}")
        p.set_data(Tensor(state[name]))
