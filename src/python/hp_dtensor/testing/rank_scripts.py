"""Ranks as fresh interpreters, for what a pool's long-lived ranks cannot show: start-up,
teardown, and more than one default group in a process's life."""

from __future__ import annotations

import os
import subprocess
import sys


def run_rank_scripts(code: str, world_size: int, *args: str, timeout: float = 120) -> list[str]:
    """Run ``python -c code RANK *args`` once per rank, all at once; each rank's stdout, in rank
    order.  A rank that exits non-zero fails with ``AssertionError`` carrying its stderr (the
    script makes its own world, e.g. on a file store under a directory passed in ``args``)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), *args], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world_size)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise AssertionError(f"rank {r} exited with {p.returncode}:\n{err}")
    return [out for out, _ in outs]
