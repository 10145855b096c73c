# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
"""Mesh start-up outside the harness: the default group from torchrun's variables (it and the
mesh's subgroups released when destroyed), clear errors for a missing launcher or device, and CommDebugMode's per-module
counts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from hp_dtensor.testing import run_rank_scripts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_default_group_starts_from_torchrun_variables() -> None:
    code = (
        "from hp_dtensor import init_device_mesh, Shard, distribute_tensor\n"
        "import torch\n"
        "mesh = init_device_mesh('cpu', (1,), mesh_dim_names=('tp',))\n"
        "d = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])\n"
        "print('ok', mesh.get_coordinate(), d.full_tensor().tolist())\n"
    )
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    out = _run(code, env)
    assert "ok (0,) [0.0, 1.0, 2.0, 3.0]" in out.stdout, out.stderr


_RELEASED = """
import gc, sys, weakref
import torch.distributed as dist
from hp_dtensor import init_device_mesh
if sys.argv[1] == "user-first":  # the script starts the group, then the library loads its backend
    dist.init_process_group("gloo")
init_device_mesh("cpu", (1,))
pg = weakref.ref(dist.group.WORLD)
import torch.distributed.checkpoint  # first imported with the group alive
dist.destroy_process_group()
gc.collect()
print("released", pg() is None)
"""


@pytest.mark.parametrize("order", ["library-first", "user-first"])
def test_destroyed_default_group_is_released(order: str) -> None:
    """Once destroyed, the default group has no reference left, even when a module that binds
    ``group.WORLD`` as a default argument at import (DCP imports one) is first imported while
    the group lives, whether the mesh or the script started it: a group kept alive runs its gloo
    threads into interpreter exit, which now and then aborts a process that finished its work."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    out = subprocess.run([sys.executable, "-c", _RELEASED, order], capture_output=True, text=True,
                         env={**os.environ, **env, "GLOO_SOCKET_IFNAME": "lo"}, timeout=120)
    assert "released True" in out.stdout, (out.stdout, out.stderr)


_SUBGROUPS = """
import gc, sys, weakref
import torch
import torch.distributed as dist
from hp_dtensor import Shard, distribute_tensor, init_device_mesh
from hp_dtensor.platform.torch.process_group import init_rank

rank, root = int(sys.argv[1]), sys.argv[2]
whole = torch.arange(12.0).reshape(4, 3)
for world in ("first", "second"):  # a second default group in the same process gets fresh subgroups
    init_rank(None, f"{root}/{world}", rank, 2, 60)
    mesh = init_device_mesh("cpu", (2, 1))  # dim 1: a one-rank group per rank
    d = distribute_tensor(whole, mesh, [Shard(0), Shard(1)])
    assert torch.equal(d.redistribute(mesh, [Shard(1), Shard(0)]).full_tensor(), whole)
    own = weakref.ref(mesh.get_group(1))
    if world == "first":
        stale = mesh
    else:
        try:  # a mesh of the first world: its groups are gone, and making them is collective
            stale.get_group(0)
        except RuntimeError as e:
            print(rank, "stale mesh refused:", "build the mesh again" in str(e))
        dist.destroy_process_group(mesh.get_group(1))  # only this rank's subgroup
        try:
            mesh.get_group(1)
        except RuntimeError as e:
            print(rank, "destroyed subgroup refused:", "was destroyed" in str(e))
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    print(rank, world, "subgroup released:", own() is None)
"""


def test_subgroups_released_and_fresh_per_default_group(tmp_path) -> None:
    """Subgroups a mesh made are c10d's alone: ``destroy_process_group`` frees them (kept alive,
    their gloo threads would run into interpreter exit); a new default group in the same
    process gets new ones, not the destroyed.  A mesh of the first default group used under the
    second, and a subgroup destroyed under a live mesh, are refused with ``RuntimeError``
    instead of a ``new_group`` collective only some ranks enter."""
    outs = run_rank_scripts(_SUBGROUPS, 2, str(tmp_path))
    for r, out in enumerate(outs):
        assert out.splitlines() == [
            f"{r} first subgroup released: True",
            f"{r} stale mesh refused: True",
            f"{r} destroyed subgroup refused: True",
            f"{r} second subgroup released: True",
        ], out


def test_missing_launcher_variables_say_what_to_do() -> None:
    code = "from hp_dtensor import init_device_mesh\ninit_device_mesh('cpu', (2,))\n"
    out = _run(code, {})
    assert "launch with torchrun" in out.stderr and "RANK" in out.stderr


def test_unavailable_device_says_what_to_install() -> None:
    import torch

    from hp_dtensor.platform.torch.process_group import backend_for

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA build of torch"):
            backend_for("cuda")
    with pytest.raises(RuntimeError, match="torch_npu"):
        backend_for("npu")
    with pytest.raises(ValueError, match="'tpu'"):
        backend_for("tpu")


def test_platform_selection_errors(monkeypatch) -> None:
    from hp_dtensor.platform import platform_name

    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "jax")
    with pytest.raises(ValueError, match="'jax'"):
        platform_name()
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "torch")
    assert platform_name() == "torch"


def test_comm_counts_by_module() -> None:
    import torch
    from torch import nn

    from hp_dtensor import CommDebugMode, Replicate, Shard, init_device_mesh
    from hp_dtensor.platform.torch import distribute_tensor
    from hp_dtensor.testing import fake_world

    class Gather(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.redistribute(x.device_mesh, [Replicate()])

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Identity(), Gather())
        comm = CommDebugMode()
        comm.track_module(model)
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)], src_data_rank=None)
        with comm:
            model(x)
            x.full_tensor()  # outside any module
        assert comm.get_comm_counts_by_module() == {"1": {"all_gather": 1}}
        assert comm.get_comm_counts() == {"all_gather": 2}
