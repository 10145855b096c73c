"""Process groups on torch.distributed: default group start-up and a cache of subgroups."""

from __future__ import annotations

import datetime
import os
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.device_mesh import check_device_type

_BACKEND_OF_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEVICE_TYPES = tuple(_BACKEND_OF_DEVICE)


def _unbind_default_group() -> None:
    """torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when it is
    first imported (torch.distributed.checkpoint imports it).  Bound to a live default group, it
    keeps that group alive past destroy_process_group: the group's gloo worker threads then run
    on into interpreter exit, where freeing a finished collective's tensors needs the GIL, and
    the process aborts ("terminate called without an active exception") after a good run.
    Imported before any group exists, it binds None, which c10d reads as the default group;
    imported after (a script that started the group itself), those defaults are set to None."""
    if not dist.is_available():
        return
    import torch.distributed.nn.functional as functional

    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None:
        return
    for fn in vars(functional).values():
        defaults = fn.__defaults__ if isinstance(fn, types.FunctionType) else None
        if defaults and any(d is world for d in defaults):
            fn.__defaults__ = tuple(None if d is world else d for d in defaults)


_unbind_default_group()


class _Subgroups:
    """The subgroups meshes asked for, by ranks, for one default group.  Held weakly: c10d owns a
    group, so ``destroy_process_group`` frees it and stops its threads (a group kept alive here
    would run them into interpreter exit).  A new default group starts an empty cache."""

    def __init__(self) -> None:
        self.world: Any = None  # weak reference to the default group these belong to
        self.generation = 0  # how many default groups this process has seen
        self.alive: weakref.WeakValueDictionary[tuple[int, ...], Any] = weakref.WeakValueDictionary()
        self.made: set[tuple[int, ...]] = set()
        self.outside: dict[tuple[int, ...], Any] = {}  # c10d's marker for a group without this rank

    def reset(self, world: Any = None) -> None:
        if world is not None:
            self.generation += 1
        self.world = None if world is None else weakref.ref(world)
        self.alive.clear()
        self.made.clear()
        self.outside.clear()


_groups = _Subgroups()


def default_device_type() -> str:
    """torch's default for a mesh nobody named: the accelerator when there is one (and this
    library has a backend for it), else "cpu"."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return acc.type if acc is not None and acc.type in _BACKEND_OF_DEVICE else "cpu"


def backend_for(device_type: str) -> str:
    device_type = check_device_type(device_type)
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device_type='cuda' but torch has no CUDA device; install a CUDA build of torch or use 'cpu'")
    if device_type == "npu":
        try:
            import torch_npu  # type: ignore[import-not-found]  # noqa: F401  # pants: no-infer-dep
        except ImportError as e:
            raise RuntimeError(
                "device_type='npu' needs torch_npu with Ascend's CANN toolkit installed"
            ) from e
    return _BACKEND_OF_DEVICE[device_type]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def ensure_process_group(device_type: str) -> None:
    """Start the default group from torchrun's environment when none exists (the device type is
    checked either way)."""
    backend = backend_for(device_type)
    if is_initialized():
        return
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in needed if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"no default process group and the launcher variables {missing} are not set; "
            f"launch with torchrun or call torch.distributed.init_process_group first"
        )
    dist.init_process_group(backend)


def init_rank(backend: str | None, path: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join a job as ``rank`` of ``world_size``: the default group rendezvouses on a FileStore at
    ``path`` (no TCP port to collide on); ``backend=None`` is gloo."""
    store = dist.FileStore(path, world_size)
    dist.init_process_group(
        backend or backend_for("cpu"), store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def serve_scheduler() -> None:
    """torch has no separate rendezvous process (ranks meet on a store): nothing to serve."""
    raise RuntimeError("the torch backend has no scheduler process; ranks rendezvous through init_rank's store")


def init_fake(rank: int, world_size: int) -> None:
    """The 'fake' backend: collectives return without moving data (geometry tests)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def destroy() -> None:
    """Leave the job.  A barrier first, so that no rank tears its groups down while a peer is
    still in its last collective."""
    _groups.reset()
    if is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_or_create_group(ranks: tuple[int, ...]) -> Any:
    """The group over ``ranks``; creating one is collective over the default group."""
    if not is_initialized():
        raise RuntimeError("no process group: call init_device_mesh (or init_process_group) first")
    world = dist.group.WORLD
    if ranks == tuple(range(dist.get_world_size())):
        return world
    _follow(world)
    group = _groups.alive.get(ranks)
    if group is not None:
        return group
    if ranks in _groups.outside:
        return _groups.outside[ranks]
    if ranks in _groups.made:
        raise RuntimeError(
            f"the process group over ranks {list(ranks)} was destroyed while a mesh still uses it; "
            f"destroy only the default group (destroy_process_group()), then build new meshes"
        )
    group = dist.new_group(list(ranks))
    _groups.made.add(ranks)
    if isinstance(group, dist.ProcessGroup):
        _groups.alive[ranks] = group
    else:
        _groups.outside[ranks] = group
    return group


def _follow(world: Any) -> None:
    if _groups.world is None or _groups.world() is not world:
        _groups.reset(world)


def world_generation() -> int:
    """Changes whenever a new default group starts in this process (0 before the first)."""
    if is_initialized():
        _follow(dist.group.WORLD)
    return _groups.generation
