# mypy: disable-error-code="no-untyped-def"
"""One device-type rule for both mesh constructors: ``DeviceMesh(...)`` and ``init_device_mesh(...)``
accept the device kinds torch spells ("cpu", "cuda", "npu") and refuse anything else, each with the
same error naming the bad value and the accepted kinds (and what was probably meant), on 2 gloo
ranks -- the same error on every rank, no hang."""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=120)

ACCEPTED = "['cpu', 'cuda', 'npu']"
BAD = {
    # value: (exception, what the message must say)
    "gpu": ("ValueError", f"device_type 'gpu' is not one of {ACCEPTED} on torch; did you mean 'cuda'?"),
    "tpu": ("ValueError", f"device_type 'tpu' is not one of {ACCEPTED} on torch"),
    "CPU": ("ValueError", f"device_type 'CPU' is not one of {ACCEPTED} on torch; did you mean 'cpu'?"),
    "Ascend": ("ValueError", f"device_type 'Ascend' is not one of {ACCEPTED} on torch; did you mean 'npu'?"),
    "cuda:0": ("ValueError", "device_type 'cuda:0' is not one of"),
    "meta": ("ValueError", "build the model on the meta device and the mesh on the device it will run on"),
    "": ("ValueError", f"device_type '' is not one of {ACCEPTED}"),
    "torch.device": ("TypeError", "device_type must be a str, one of ['cpu', 'cuda', 'npu'], got device"),
}


def _attempt(rank: int, world: int, ctor: str, value: str) -> str:
    import torch

    from hp_dtensor import DeviceMesh, init_device_mesh

    device_type: Any = torch.device("cpu") if value == "torch.device" else value
    try:
        if ctor == "DeviceMesh":
            mesh = DeviceMesh(device_type, list(range(world)))
        else:
            mesh = init_device_mesh(device_type, (world,))
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return f"ok {mesh.device_type} {mesh.shape}"


@pytest.mark.parametrize("ctor", ["DeviceMesh", "init_device_mesh"])
@pytest.mark.parametrize("value", sorted(BAD))
def test_both_constructors_refuse_the_same_bad_device_type(pool2: RankPool, ctor: str, value: str) -> None:
    kind, text = BAD[value]
    results = pool2.run(_attempt, ctor, value)
    assert len(set(results)) == 1, results
    assert results[0].startswith(f"{kind}: ") and text in results[0], results[0]
    if value == "torch.device":
        assert "pass its kind, device_type='cpu'" in results[0]
    if value == "cuda:0":
        assert "pass 'cuda'" in results[0]


@pytest.mark.parametrize("ctor", ["DeviceMesh", "init_device_mesh"])
def test_both_constructors_accept_cpu(pool2: RankPool, ctor: str) -> None:
    assert pool2.run(_attempt, ctor, "cpu") == ["ok cpu (2,)"] * 2


def test_a_device_kind_without_the_device_says_what_to_install(pool2: RankPool) -> None:
    """"cuda" and "npu" pass the name rule; without the device, both constructors raise the
    backend's RuntimeError saying what to install, instead of building a mesh."""
    import torch

    kinds = ["npu"] + ([] if torch.cuda.is_available() else ["cuda"])
    for kind in kinds:
        for ctor in ("DeviceMesh", "init_device_mesh"):
            results = pool2.run(_attempt, ctor, kind)
            assert len(set(results)) == 1, results
            want = "torch_npu" if kind == "npu" else "CUDA build of torch"
            assert results[0].startswith("RuntimeError: ") and want in results[0], (ctor, results[0])


def test_slicing_keeps_the_checked_device_type(pool2: RankPool) -> None:
    assert pool2.run(_slice) == ["cpu cpu"] * 2


def _slice(rank: int, world: int) -> str:
    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    return f"{mesh['dp'].device_type} {mesh['tp'].device_type}"
