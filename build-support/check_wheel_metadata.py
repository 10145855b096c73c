"""Checks the Requires-Dist of every wheel in a folder (run by check_wheels.sh).

- First-party requirements are exactly the package's edges: what it must require, plus what it
  may require (an allowed edge it does not use yet), as compatible ranges ``~=X.Y.Z`` on the
  version of the wheel built next to it.
- A framework (torch, mindspore) and numpy appear only under an extra, never in the base set.
- No third-party requirement is an exact pin.

Adding a package means adding its row below (and, for the umbrella, nothing: it must require
every other package built).
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

# package -> (must require, may also require)
EDGES: dict[str, tuple[set[str], set[str]]] = {
    "hp-dtensor": (set(), set()),
    "hp-tp": ({"hp-dtensor"}, set()),
    "hp-fsdp": ({"hp-dtensor"}, set()),
    "hp-protocols": ({"hp-dtensor"}, set()),
    "hp-checkpoint": ({"hp-dtensor"}, set()),
    "hp-cp": ({"hp-dtensor"}, {"hp-tp"}),
    "hp-pp": ({"hp-dtensor"}, set()),
    "hp-ep": ({"hp-dtensor", "hp-tp"}, set()),
    "hp-models": ({"hp-tp", "hp-protocols", "hp-checkpoint", "hp-dtensor"}, {"hp-fsdp", "hp-cp", "hp-pp", "hp-ep"}),
}
UMBRELLA = "hyper-parallel"
FRAMEWORKS = {"torch", "mindspore", "numpy"}
_REQ = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(?:\(([^)]*)\)|([^;]*))?\s*(?:;\s*(.*))?$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(folder: str) -> int:
    wheels = sorted(Path(folder).glob("*.whl"))
    meta: dict[str, tuple[str, list[str]]] = {}
    for whl in wheels:
        with zipfile.ZipFile(whl) as zf:
            (path,) = (n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            msg = Parser().parsestr(zf.read(path).decode())
        meta[_norm(msg["Name"])] = (msg["Version"], msg.get_all("Requires-Dist") or [])
    first_party = set(meta)
    errors: list[str] = []
    for name, (version, reqs) in sorted(meta.items()):
        must: set[str]
        may: set[str]
        if name == UMBRELLA:
            must, may = first_party - {UMBRELLA}, set()
        elif name in EDGES:
            must, may = EDGES[name]
        else:
            errors.append(f"{name}: no row in EDGES of {__file__}; add its allowed package edges")
            continue
        base_fp: set[str] = set()
        print(f"{name} {version}")
        for req in reqs:
            print(f"  Requires-Dist: {req}")
            m = _REQ.match(req.strip())
            if not m:
                errors.append(f"{name}: cannot parse requirement {req!r}")
                continue
            dep, spec, marker = _norm(m.group(1)), (m.group(3) or m.group(4) or "").strip(), m.group(5)
            if dep in first_party:
                if marker:  # an extra forwarding a framework to a package this one requires: bare,
                    # so the version comes from the base set
                    if spec or (dep not in must | may and name != UMBRELLA):
                        errors.append(f"{name}: extra requirement {req!r} must be a bare [...] of a package it requires")
                    continue
                base_fp.add(dep)
                if spec != f"~={meta[dep][0]}":
                    errors.append(f"{name}: {req!r} must be the compatible range ~={meta[dep][0]}")
            else:
                if "==" in spec:
                    errors.append(f"{name}: {req!r} is an exact pin; use a range")
                if dep in FRAMEWORKS and not (marker and "extra" in marker):
                    errors.append(f"{name}: {req!r} forces a framework or numpy; move it to an extra")
        if not must <= base_fp <= must | may:
            errors.append(
                f"{name}: first-party requirements {sorted(base_fp)}; must be {sorted(must)}"
                + (f" plus any of {sorted(may)}" if may else "")
            )
    for err in errors:
        print(f"FAIL: {err}", file=sys.stderr)
    if not errors:
        print(f"ok: {len(meta)} wheels list exactly their allowed first-party edges, ~= ranges, frameworks in extras")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
