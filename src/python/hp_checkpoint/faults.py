"""Fault injection for checkpoint crash tests: a rank kills itself at a named moment of a save.

Off unless the environment sets ``HP_CHECKPOINT_FAULT=<point>@<rank>[:<step>]``; then that rank
sends itself SIGKILL when its save (of that step, or of any) reaches ``<point>``.  Both sharded
checkpoint formats (DCP and safetensors shards) mark the same moments, so one crash test
vocabulary covers both.
"""

from __future__ import annotations

import enum
import os
import signal

FAULT_ENV = "HP_CHECKPOINT_FAULT"


class FaultPoint(enum.StrEnum):
    """Moments of a save at which a crash test may kill a rank."""

    STAGED = "staged"  # the staging directory exists, nothing written
    FILES_WRITTEN = "files-written"  # this rank's files written and fsynced, no checksum gathered
    BEFORE_MANIFEST = "before-manifest"  # rank 0 holds every checksum, manifest not written
    BEFORE_COMMIT = "before-commit"  # manifest written, directory not renamed
    AFTER_COMMIT = "after-commit"  # (rank 0) renamed, other ranks not told
    RETURNING = "returning"  # every rank told of the commit, save not returned
    PRUNING = "pruning"  # (rank 0) a pruned step renamed aside, its files not yet deleted


def crash_point(point: FaultPoint, rank: int, step: int) -> None:
    """Kill this process with SIGKILL if ``HP_CHECKPOINT_FAULT`` names ``point`` for ``rank``
    (and ``step``, when it gives one); otherwise do nothing."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec in (f"{point}@{rank}", f"{point}@{rank}:{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["FAULT_ENV", "FaultPoint", "crash_point"]
