"""Running the ranks: each rank's entry point, the launch (``hp_models.launch`` supervises
them and names a rank that dies), and the errors a user can fix, reported as one line."""

from __future__ import annotations

import errno
import os
import traceback
from typing import Any

from hp_models.job import TrainLayout
from hp_models.launch import launch
from hp_models.trainer.args import Args

# Errors of the file system a user fixes (a full or read-only disk, a missing permission, a file
# in the way of a directory): reported as one line, not a traceback.
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                          errno.EEXIST, errno.EISDIR})


def user_error(error: BaseException) -> str | None:
    """One line for an error the user causes and can fix (a checkpoint that is damaged or of
    another run, a disk that refuses the files), else ``None``."""
    from hp_checkpoint.manifest import describe_os_error
    from hp_dtensor.layout.shard_boxes import CheckpointError

    if isinstance(error, CheckpointError):
        return " ".join(str(error).split("\n"))
    if isinstance(error, OSError) and error.errno in _USER_ERRNOS:
        return describe_os_error(error, "cannot write")
    return None


def _worker(rank: int, world: int, args: Args, layout: TrainLayout, store: str, results: Any,
            launcher_pid: int) -> None:
    try:
        from hp_models.launch import die_with_parent

        die_with_parent(launcher_pid)
        from hp_dtensor.platform import current
        from hp_models.trainer.checks import load_config
        from hp_models.trainer.loop import train

        plat = current()
        plat.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        plat.init_rank("gloo", store, rank, world, timeout_s=600)
        out = train(args, layout, load_config(args), rank, distributed=True)
        plat.destroy()
        results.put((rank, True, out if rank == 0 else None))
    except BaseException as e:
        line = user_error(e)
        results.put((rank, False, ("user", line) if line is not None else ("traceback", traceback.format_exc())))


# What every rank imports before its first step, imported once by the launcher's fork server.
# torch imports the last two lazily, the first time a DTensor becomes a Parameter and an
# optimizer is built.
RANK_MODULES = ("hp_models.trainer.loop", "hp_models.trainer.checks", "hp_models.train_checkpoint",
                "hp_dtensor.platform.torch", "torch.distributed.tensor", "torch._dynamo")


def run_spawned(args: Args, layout: TrainLayout) -> dict[str, Any]:
    """Start the ranks and wait for them.  A rank that fails or dies (killed, out of memory) stops
    the job: the others are killed and the error names the rank; the ranks die with the launcher."""
    out: dict[str, Any] = launch(layout.world_size, _worker, (args, layout), preload=RANK_MODULES)
    return out
