"""The device-type rule on MindSpore (a world of one, no launcher): both mesh constructors accept
"cpu" and refuse "gpu", "cuda", "CPU" and "Ascend" with the same ValueError naming the value and
the kinds MindSpore meshes take ("cpu", "npu")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

ACCEPTED = "['cpu', 'npu']"


@pytest.fixture(scope="module", autouse=True)
def _leave_no_world_behind() -> Iterator[None]:
    """The meshes built here join a world of one; leave it for the next file of a batched pytest
    process to start afresh."""
    yield
    from hp_dtensor.platform import current

    current().destroy()


def _build(ctor: str, device_type: Any) -> Any:
    from hp_dtensor import DeviceMesh, init_device_mesh

    return DeviceMesh(device_type, [0]) if ctor == "DeviceMesh" else init_device_mesh(device_type, (1,))


@pytest.mark.parametrize("ctor", ["DeviceMesh", "init_device_mesh"])
def test_cpu_is_accepted(ctor: str) -> None:
    mesh = _build(ctor, "cpu")
    assert mesh.device_type == "cpu" and mesh.shape == (1,)


@pytest.mark.parametrize("ctor", ["DeviceMesh", "init_device_mesh"])
@pytest.mark.parametrize("value,hint", [
    ("gpu", ""), ("cuda", ""), ("CPU", "; did you mean 'cpu'?"), ("Ascend", "; did you mean 'npu'?"),
])
def test_the_same_refusal_from_both_constructors(ctor: str, value: str, hint: str) -> None:
    with pytest.raises(ValueError) as e:
        _build(ctor, value)
    assert str(e.value) == f"device_type {value!r} is not one of {ACCEPTED} on mindspore{hint}"


def test_default_device_type_is_the_process_device() -> None:
    from hp_dtensor.platform import current

    _build("init_device_mesh", "cpu")
    assert current().default_device_type() == "cpu"



_KERNEL_THEN_MESH = """
import numpy as np
from mindspore import Tensor, ops
from hp_dtensor import init_device_mesh
from hp_dtensor.platform import current
assert float(ops.add(Tensor(np.ones(2, np.float32)), 1).asnumpy().sum()) == 4.0
mesh = init_device_mesh("cpu", (1,))
assert mesh.shape == (1,) and current().default_device_type() == "cpu"
current().destroy()
try:
    init_device_mesh("npu", (1,))
except RuntimeError as e:
    assert "needs MindSpore built for Ascend; this MindSpore cannot use it" in str(e), e
else:
    raise AssertionError("an npu mesh was built on a CPU-only MindSpore")
print("ok")
"""


def test_a_mesh_after_kernels_ran_in_the_process() -> None:
    """MindSpore refuses set_device once a kernel has run in a process; a cpu mesh is still built
    there (the runtime already runs on CPU), so test files batched in one pytest process need no
    order, and an npu mesh on this CPU-only MindSpore is still refused as one it cannot use.  A
    fresh interpreter: this file's other tests have set the device already."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _KERNEL_THEN_MESH], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
