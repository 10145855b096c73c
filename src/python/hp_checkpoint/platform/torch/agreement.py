"""How the ranks of a torch save agree: small Python objects moved over a group, and a group of
the checkpoint writer's own.

A save shares rank 0's decisions (the staging folder's nonce, the committed path) and gathers
every rank's outcome, so a failure on one rank raises on all.  An asynchronous save runs those
collectives from a background thread, on a gloo group created for it, so they never interleave
with the training's on the default group.  Counted by ``CommDebugMode`` like every collective.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hp_dtensor.comm_debug import record
from hp_dtensor.platform.torch.collectives import all_gather_object as all_gather_object  # re-exported


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (default: the world; itself without
    a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    record("broadcast_object", 0, dist.get_world_size(group))
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def new_world_group() -> Any:
    """A second group of every rank (gloo), for collectives issued from a background thread;
    ``None`` without a process group.  Collective: every rank calls it, in the same order."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")
