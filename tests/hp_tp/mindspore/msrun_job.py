# mypy: disable-error-code="import-not-found,import-untyped"
"""A job started by ``msrun`` in test_ms_msrun: each rank builds the same MLP, keeps a
single-process result, parallelizes it (Colwise + Rowwise on 2 ranks) and writes both results and
its rank to ``$HP_MSRUN_OUT/rank<r>.json``."""

from __future__ import annotations

import json
import os

import mindspore as ms
import numpy as np
from ms_cases import ms_grads, ms_mlp, weights

from hp_dtensor import init_device_mesh
from hp_dtensor.platform import current
from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    W = weights(11)
    x, up = ms.Tensor(W["x"]), ms.Tensor(W["g_hidden"])
    ref = ms_grads(ms_mlp(W), x, up)
    tp = ms_grads(parallelize_module(ms_mlp(W), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}), x, up)
    out = {
        "rank": mesh.get_rank(), "world": current().get_world_size(),
        "out_diff": float(np.abs(tp["out"] - ref["out"]).max()),
        "dx_diff": float(np.abs(tp["dx"] - ref["dx"]).max()),
        "down_bias_diff": float(np.abs(tp["d:down.bias"] - ref["d:down.bias"]).max()),
    }
    with open(os.path.join(os.environ["HP_MSRUN_OUT"], f"rank{mesh.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    current().destroy()


if __name__ == "__main__":
    main()
