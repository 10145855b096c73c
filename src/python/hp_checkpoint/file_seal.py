"""Make a save's files durable and checksum them in the background while its collectives finish.

A rank that has written its files still waits in the save's closing collectives for the slower
ranks (and for the coordinator's index).  ``FileSeal`` spends that wait on what the manifest needs
from those files anyway: each file is fsynced and its size and sha256 computed (read back from the
page cache, in chunks) on a thread of its own.  ``result()`` joins it; the manifest is written only
after every rank's ``result()``, so a checkpoint is still never committed before its files are
durable and checksummed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from hp_checkpoint.manifest import FileEntry, checked_relpath, file_entries


class FileSeal:
    """fsync and checksum the files ``relpaths`` under ``directory`` on a background thread,
    started at construction; ``result()`` waits for it."""

    def __init__(self, directory: str, relpaths: Iterable[str]) -> None:
        self._directory = directory
        # a name that leaves the directory fails here, on the caller's thread
        self._relpaths = [checked_relpath(rel, directory) for rel in relpaths]
        self._entries: dict[str, FileEntry] = {}
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="hp-checkpoint-seal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._entries = file_entries(self._directory, self._relpaths)  # fsync, then size and sha256
        except OSError as e:  # a disk error reaches the caller of result(), on its thread
            self._error = e

    def result(self) -> dict[str, FileEntry]:
        """Each file's size and sha256, once all are fsynced; re-raises the ``OSError`` that
        stopped it (a file removed or unreadable, a failing disk)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return dict(self._entries)
