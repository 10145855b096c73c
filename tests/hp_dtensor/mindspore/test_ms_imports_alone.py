"""The MindSpore backend has no import loops, and each of its modules imports on its own in a fresh
interpreter (a loop that only bites in some import order fails here with its ImportError)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hp_dtensor.platform.mindspore as backend
from hp_dtensor.testing.import_graph import cycles, import_graph, without_package_inits


def test_each_backend_module_imports_alone() -> None:
    root = Path(backend.__file__).parent
    names = ["hp_dtensor.platform.mindspore"] + [
        f"hp_dtensor.platform.mindspore.{p.stem}" for p in sorted(root.glob("*.py")) if p.stem != "__init__"
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HYPER_PARALLEL_PLATFORM": "mindspore"}
    failures = []
    for name in names:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env,
                              timeout=180)
        if proc.returncode != 0:
            failures.append(f"{name}:\n{proc.stderr[-2000:]}")
    print(f"modules imported alone: {len(names)}, failed: {len(failures)}")
    assert len(names) > 10 and failures == [], "\n".join(failures)


def test_no_import_cycles_in_the_backend() -> None:
    graph = without_package_inits(import_graph())
    assert any(n.startswith("hp_dtensor.platform.mindspore.") for n in graph), sorted(graph)
    found = [c for c in cycles(graph) if any(n.startswith("hp_dtensor.platform.mindspore") for n in c)]
    assert found == [], found
