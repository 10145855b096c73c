"""Ranks spawned by the trainer die with their launcher.

A launcher killed with SIGKILL runs no cleanup, so its ranks would go on training (and writing
checkpoints) with nobody to report to.  On Linux the kernel delivers SIGKILL to a rank when its
parent dies (``PR_SET_PDEATHSIG``); elsewhere a daemon thread polls the parent's pid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int, period_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(period_s)
    _kill_self()


def die_with_parent(parent: int, *, period_s: float = 0.5) -> None:
    """Make this process die when ``parent`` (the launcher's pid) does, also if it already has."""
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent:  # the launcher died before the request took effect
        _kill_self()
    if not armed:
        threading.Thread(target=_watch, args=(parent, period_s), daemon=True, name="die-with-parent").start()
