"""Asynchronous atomic checkpoints: copy to CPU memory now, write in the background.

``AsyncCheckpointer.save`` copies the state dict's tensors (each rank its own shards) and returns;
a background thread then does everything ``save_checkpoint`` does (DCP files, fsync, checksums,
manifest, rename, prune), its collectives on a process group of its own so they never
interleave with the training's.  Training goes on meanwhile; only the copy holds it up.  At most
one save is in flight: the next ``save`` (or ``wait``) first waits for the previous one and
raises its error, if any, on every rank.

Every rank creates the checkpointer at the same point (it creates the process group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from hp_checkpoint.atomic import save_checkpoint
from hp_checkpoint.dcp import DCPPrimitives
from hp_checkpoint.platform import feature

# Test hook (off unless set): called in the background thread before it writes anything, so a
# test can hold the writer and show that training does not wait for it.
before_write: Callable[[], None] | None = None


class AsyncCheckpointer:
    """Atomic checkpoints written in the background; see the module doc."""

    def __init__(self) -> None:
        self._dcp: DCPPrimitives = feature("DCP", "asynchronous checkpoints")
        self._group = self._dcp.new_world_group()
        self._thread: threading.Thread | None = None
        self._result: str | None = None
        self._error: BaseException | None = None

    def save(self, state_dict: Mapping[str, Any], root: str, step: int, *,
             extra: Mapping[str, Any] | None = None, keep: int | None = None) -> None:
        """Copy ``state_dict`` to CPU memory and write it as ``<root>/step-<N>`` in the background."""
        self.wait()
        staged = self._dcp.stage_to_cpu(dict(state_dict))
        extra_copy = dict(extra or {})
        self._result, self._error = None, None
        self._thread = threading.Thread(
            target=self._write, args=(staged, root, step, extra_copy, keep), name=f"checkpoint-step-{step}", daemon=True
        )
        self._thread.start()

    def _write(self, staged: dict[str, Any], root: str, step: int, extra: dict[str, Any], keep: int | None) -> None:
        try:
            if before_write is not None:
                before_write()
            self._result = save_checkpoint(staged, root, step, extra=extra, keep=keep, group=self._group)
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e

    def done(self) -> bool:
        """True when no save is in flight."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str | None:
        """Wait for the save in flight; returns its checkpoint path (``None`` when there was
        none) or raises its error."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result


__all__ = ["AsyncCheckpointer", "before_write"]
