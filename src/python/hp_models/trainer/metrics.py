"""What each step reports: the progress bar on rank 0."""

from __future__ import annotations

import sys


def progress(step: int, total: int, loss: float, tok_s: float) -> None:
    width = 30
    filled = int(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    line = f"[{bar}] step {step}/{total}  loss {loss:.4f}  {tok_s:,.0f} tok/s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line)
    elif step == total or step % max(1, total // 20) == 0:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
