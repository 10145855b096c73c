"""Process groups on ``mindspore.communication``: start-up from the launcher and named subgroups.

MindSpore launches ranks with ``msrun`` or the ``MS_ROLE`` / ``MS_SCHED_HOST`` / ``MS_SCHED_PORT`` /
``MS_WORKER_NUM`` / ``MS_NODE_ID`` variables; ``init()`` then picks mccl on CPU and hccl on Ascend.
Without those variables the process is a world of one (rank 0): meshes of size 1 work and no
collective is ever issued, which is what single-process tests and geometry checks need.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from hp_dtensor.device_mesh import check_device_type
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.world import _state
from hp_dtensor.platform.mindspore.world import device_target as device_target  # re-exported
from hp_dtensor.platform.mindspore.world import world_group as world_group  # re-exported

_DEVICE_TARGET = {"cpu": "CPU", "npu": "Ascend"}
DEVICE_TYPES = tuple(_DEVICE_TARGET)
_LAUNCH_VARS = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM")

_groups: dict[tuple[int, ...], str] = {}


def is_initialized() -> bool:
    return bool(_state["initialized"])


def default_device_type() -> str:
    """The device kind of a mesh nobody named: the one this process runs MindSpore on once it has
    joined a job, else the target this MindSpore was built for ("npu" on Ascend, else "cpu")."""
    if _state["initialized"]:
        target = str(_state["device"])
    else:
        import mindspore as ms

        target = str(ms.get_context("device_target"))
    return "npu" if target == "Ascend" else "cpu"


def ensure_process_group(device_type: str) -> None:
    """Join the job the launcher started (msrun or the MS_* variables); a world of one when the
    process was started on its own."""
    device_type = check_device_type(device_type)
    if _state["initialized"]:
        if _DEVICE_TARGET[device_type] != _state["device"]:
            raise RuntimeError(
                f"this process already runs MindSpore on {_state['device']}; a {device_type!r} mesh needs a "
                f"process started for it"
            )
        return
    import mindspore as ms

    target = _DEVICE_TARGET[device_type]
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ms.set_device(target)
    except (RuntimeError, ValueError) as e:
        # MindSpore refuses set_device once a kernel has run in the process (a single-process
        # computation, or an earlier job this process left).  The device cannot change then, so
        # the request is honoured when the runtime already runs on the target.
        if "has been initialized" in str(e):
            running = str(ms.get_context("device_target"))
            if running != target:
                raise RuntimeError(
                    f"device_type={device_type!r} needs MindSpore on {target}, but this process already runs "
                    f"MindSpore kernels on {running}; start a new process for it"
                ) from e
        else:
            raise RuntimeError(
                f"device_type={device_type!r} needs MindSpore built for {target}; this MindSpore cannot use it ({e})"
            ) from e
    _state["device"] = target
    present = [k for k in _LAUNCH_VARS if k in os.environ]
    if not present and "RANK_TABLE_FILE" not in os.environ:
        _state.update(initialized=True, single=True)
        return
    missing = [k for k in _LAUNCH_VARS if k not in os.environ]
    if missing and "RANK_TABLE_FILE" not in os.environ:
        raise RuntimeError(
            f"MindSpore launcher variables {missing} are missing (found {present}); launch with msrun "
            f"or set all of {list(_LAUNCH_VARS)} and MS_NODE_ID"
        )
    from mindspore.communication import init

    if os.environ.get("MS_ROLE") == "MS_WORKER":
        _wait_for_scheduler(os.environ["MS_SCHED_HOST"], int(os.environ["MS_SCHED_PORT"]))
    init()
    _state.update(initialized=True, single=False)


def _wait_for_scheduler(host: str, port: int, limit_s: float = 60.0) -> None:
    """Return once the scheduler accepts connections (or after ``limit_s``: ``init()`` then
    reports the failure itself).  Launchers start the scheduler and the workers together, and a
    worker importing faster than its scheduler connects first: MindSpore 2.10's worker then
    registers through a reconnect path that kept failing for 10 to 20 s on this machine, where
    one that finds the scheduler listening registers at once."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)


def init_rank(backend: str | None, path: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join a job as ``rank`` of ``world_size`` on CPU (mccl).  MindSpore rendezvouses at its
    scheduler, whose address the launcher (msrun, RankPool) put in the MS_* variables, so ``path``
    (a file-store rendezvous) is not used; ``backend`` must be ``None`` or ``"mccl"``: a torch
    backend name (gloo, nccl) cannot be honoured and raises ``ValueError``."""
    if backend not in (None, "mccl"):
        raise ValueError(
            f"backend={backend!r} is not a MindSpore CPU communication backend; pass None or 'mccl' "
            f"(MindSpore picks hccl itself on Ascend)"
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ensure_process_group("cpu")
    if get_world_size() != world_size or get_rank() != rank:
        raise RuntimeError(
            f"MindSpore started rank {get_rank()} of {get_world_size()}, the pool expected {rank} of {world_size}; "
            f"set MS_WORKER_NUM={world_size} and MS_NODE_ID={rank} (or launch with msrun)"
        )


def serve_scheduler() -> None:
    """Run MindSpore's scheduler role (``MS_ROLE=MS_SCHED`` with the launcher variables set):
    serves the workers' rendezvous until they are done.  What msrun starts next to the workers."""
    from mindspore.communication import init

    init()


def init_fake(rank: int, world_size: int) -> None:
    raise NotImplementedError(
        "MindSpore has no fake process group; run geometry checks on the torch backend or on a 1-rank mesh"
    )


def destroy() -> None:
    """Leave the job.  A last small all_reduce first: on mccl a rank that exits while a peer still
    has a collective pending kills that collective."""
    if not _state["initialized"]:
        return
    if not _state["single"]:
        C.COLLECTIVES.barrier(world_group(), get_world_size())
        from mindspore.communication import release

        release()
    _groups.clear()
    _state.update(initialized=False, single=False)


def get_rank() -> int:
    if not _state["initialized"] or _state["single"]:
        return 0
    from mindspore.communication import get_rank as _get_rank

    return int(_get_rank())


def get_world_size() -> int:
    if not _state["initialized"] or _state["single"]:
        return 1
    from mindspore.communication import get_group_size

    return int(get_group_size())


def get_or_create_group(ranks: tuple[int, ...]) -> Any:
    """The group name over ``ranks`` (the world group when it spans every rank).  MindSpore creates
    a group on its members only (a non-member creating it fails), so other ranks just learn its
    name.  A world of one has no groups: collectives on size-1 mesh dims are identities and never
    reach MindSpore."""
    if not _state["initialized"]:
        raise RuntimeError("no process group: call init_device_mesh first")
    if _state["single"]:
        return None
    if ranks == tuple(range(get_world_size())):
        return world_group()
    name = _groups.get(ranks)
    if name is None:
        name = "hp_" + "_".join(str(r) for r in ranks)
        if get_rank() in ranks:
            from mindspore.communication import create_group

            create_group(name, list(ranks))
        _groups[ranks] = name
    return name


def world_generation() -> int:
    """MindSpore starts its communication once per process: one default group, ever."""
    return 0
