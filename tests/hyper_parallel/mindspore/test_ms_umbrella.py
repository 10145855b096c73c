"""The umbrella package on a MindSpore-only machine: ``hyper_parallel`` imports and runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys


def test_hyper_parallel_imports_and_runs_without_torch():
    """With torch absent and HYPER_PARALLEL_PLATFORM unset, the installed MindSpore is chosen."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, mindspore as ms\n"
        "from hyper_parallel import ColwiseParallel, init_device_mesh, parallelize_module, Shard\n"
        "from hp_dtensor.platform import current\n"
        "d = parallelize_module(ms.nn.Dense(4, 6), init_device_mesh('cpu', (1,)), ColwiseParallel())\n"
        "assert d.weight.placements == (Shard(0),)\n"
        "print(current().NAME, tuple(d(ms.Tensor(np.ones((2, 4), np.float32))).shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("mindspore (2, 6)")
