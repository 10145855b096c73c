"""Processes forked from ``multiprocessing``'s fork server that die with the process that asked.

A rank pool and the trainer's launcher fork their ranks from the fork server of the process that
starts them (the test process, the launcher), which has imported the framework once.  The ranks
are the server's children, not the starter's: killed with SIGKILL, the starter runs no cleanup and
its ranks would go on waiting for work (or training) with nobody to report to.  Three pieces close
that, each needed:

- ``let_go_of_the_fork_server``: every forked process inherits a copy of the starter's end of the
  server's keep-alive pipe (so that it could use the server itself); the server exits only when
  every copy is closed, so each rank closes its copy first, and so does a starter that was itself
  forked from another process's server (it starts a server of its own);
- ``die_with_parent``: on Linux the kernel then kills a rank when its parent, the server, exits
  (``PR_SET_PDEATHSIG``); elsewhere a daemon thread polls the parent's pid;
- ``add_preload``: ``multiprocessing`` keeps one preload list per process and its setter replaces
  it, so every user of the server adds to the list it finds.

Standard library only, no framework: the trainer's launcher and the test harness share it.
"""

from __future__ import annotations

import ctypes
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def add_preload(modules: Sequence[str]) -> None:
    """Add ``modules`` to what this process's fork server imports when it starts (no effect once
    it runs), keeping what other users of the server added."""
    current = list(getattr(mp_forkserver._forkserver, "_preload_modules", ["__main__"]))
    mp_forkserver.set_forkserver_preload(current + [m for m in modules if m not in current])


def let_go_of_the_fork_server() -> None:
    """Close this process's inherited copy of the fork server's keep-alive pipe (a no-op in the
    process that started the server, or in one that already let go).  Afterwards the process can
    still use a fork server: ``multiprocessing`` starts one of its own."""
    server = mp_forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", None) is None:  # inherited, not our own server's
        os.close(fd)
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010 (not in the stubs)
        setattr(server, "_forkserver_address", None)  # noqa: B010


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int, period_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(period_s)
    _kill_self()


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc`` (None where there is no ``/proc`` or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process of that pid: ours is gone
        return False
    return True


def die_with_parent(starter: int, *, period_s: float = 0.5) -> None:
    """Make this process die when ``starter`` (the pid of the process that asked for it) does, also
    if it already has.

    The parent is the starter itself (spawned) or the starter's fork server (forked), which ends
    when the starter does once every rank has let go of it; the kernel kills this process when its
    parent ends.  A parent that is neither (this process was re-parented because its parent
    already ended) means the starter is gone."""
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: no ldconfig run
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    parent = os.getppid()
    if parent != starter:
        grandparent = _parent_of(parent)
        # Re-parented (the starter's server is gone), or without /proc the starter itself gone:
        # the starter ended before the request took effect.
        if (grandparent is not None and grandparent != starter) or (grandparent is None and not _alive(starter)):
            _kill_self()
    if not armed:
        threading.Thread(target=_watch, args=(parent, period_s), daemon=True, name="die-with-parent").start()


__all__ = ["add_preload", "die_with_parent", "let_go_of_the_fork_server"]
