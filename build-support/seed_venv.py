"""Seed a fresh venv with one distribution and what it requires, hard-linked from this interpreter's
installation: ``python seed_venv.py DIST DEST_VENV``, run by the venv that holds ``DIST``.

``check_wheels.sh`` installs each package alone in a fresh venv, always with ``hp-dtensor[torch]``,
whose extra requires torch; unpacking torch's ~700 MB wheel again for every venv was most of that
stage's time.  Linking the files of an already installed torch is the same install (pip then finds
the requirement satisfied, at the pinned version), so what those venvs prove is unchanged: which
first-party distributions each package pulls in, and that its example runs.  Console scripts are
copied with their first line pointed at the new venv's interpreter, so ``DEST_VENV/bin/torchrun``
runs there.  Only requirements without an extra and whose markers hold are followed; anything the
new venv already has is left as it is (``check_wheels.sh`` makes its venvs without pip and
installs into them with the first venv's pip, so usually nothing).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement  # the venv's own pip; no extra install


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(root: str) -> list[md.Distribution]:
    """``root`` and every installed distribution its unconditional requirements reach."""
    installed = {_norm(d.metadata["Name"]): d for d in md.distributions()}
    todo, seen = [_norm(root)], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in installed:
            raise SystemExit(f"seed_venv: {name} is not installed in {sys.prefix}")
        dist = seen[name] = installed[name]
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return list(seen.values())


def seed(root: str, dest: Path) -> int:
    """Link ``root``'s closure into venv ``dest``; returns the number of files placed."""
    src_site = Path(sysconfig.get_paths()["purelib"]).resolve()
    dest_site = dest / src_site.relative_to(Path(sys.prefix).resolve())
    python = (dest / "bin" / "python").absolute()
    have = {_norm(d.metadata["Name"]) for d in md.distributions(path=[str(dest_site)])}
    placed = 0
    for dist in closure(root):
        if _norm(dist.metadata["Name"]) in have:
            continue
        for rel in dist.files or ():
            src = Path(dist.locate_file(rel)).resolve()
            if not src.is_file():
                continue
            if src.is_relative_to(src_site):
                target = dest_site / src.relative_to(src_site)
            else:  # a console script in bin/
                target = dest / src.relative_to(Path(sys.prefix).resolve())
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.parent.name == "bin":
                first, _, rest = src.read_bytes().partition(b"\n")
                head = f"#!{python}".encode() if first.startswith(b"#!") else first
                target.write_bytes(head + b"\n" + rest)
                shutil.copymode(src, target)
            else:
                try:
                    os.link(src, target)
                except OSError:
                    shutil.copy2(src, target)
            placed += 1
    return placed


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: seed_venv.py DIST DEST_VENV")
    n = seed(sys.argv[1], Path(sys.argv[2]))
    print(f"seeded {sys.argv[2]} with {sys.argv[1]} and its requirements ({n} files linked)")
