"""Ranks as fresh interpreters, for what a pool's long-lived ranks cannot show: start-up,
teardown, and more than one default group in a process's life."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def run_rank_scripts(code: str, world_size: int, *args: str, timeout: float = 120) -> list[str]:
    """Run ``python -c code RANK *args`` once per rank, all at once; each rank's stdout, in rank
    order.  A rank that exits non-zero, or is still running after ``timeout`` seconds (all ranks
    together), fails with ``AssertionError`` carrying every rank's stderr.  The script makes its
    own world, e.g. on a file store under a directory passed in ``args``."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    with tempfile.TemporaryDirectory(prefix="hp-rank-scripts-") as logs:
        # files, not pipes: a rank that writes much cannot block while its peers wait on it
        outs = [open(os.path.join(logs, f"{r}.out"), "w+") for r in range(world_size)]
        errs = [open(os.path.join(logs, f"{r}.err"), "w+") for r in range(world_size)]
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), *args], env=env, text=True,
                                  stdout=outs[r], stderr=errs[r]) for r in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for f in outs + errs:
            f.seek(0)
            texts.append(f.read())
            f.close()
    stdout, stderr = texts[:world_size], texts[world_size:]
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if timed_out or failed:
        what = f"still running after {timeout} s" if timed_out else f"ranks {failed} exited non-zero"
        detail = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n{stderr[r]}" for r in range(world_size))
        raise AssertionError(f"{what}\n{detail}")
    return stdout
