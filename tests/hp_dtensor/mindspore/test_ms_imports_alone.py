"""The MindSpore backend has no import loops, and each of its modules imports on its own, as the
first module of the package in its interpreter (one interpreter imports MindSpore once and forks a
child per module; a loop that only bites in some import order fails here with its ImportError)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hp_dtensor.platform.mindspore as backend
from hp_dtensor.testing.import_graph import cycles, import_each_alone, import_graph, without_package_inits


def test_each_backend_module_imports_alone() -> None:
    root = Path(backend.__file__).parent
    names = ["hp_dtensor.platform.mindspore"] + [
        f"hp_dtensor.platform.mindspore.{p.stem}" for p in sorted(root.glob("*.py")) if p.stem != "__init__"
    ]
    env = {"PYTHONPATH": os.pathsep.join(sys.path), "HYPER_PARALLEL_PLATFORM": "mindspore"}
    found = import_each_alone(names, preload=("mindspore",), env=env, timeout_s=180)
    failures = [f"{name}:\n{err[-2000:]}" for name, err in found.items()]
    print(f"modules imported alone: {len(names)}, failed: {len(failures)}")
    assert len(names) >= 10 and failures == [], "\n".join(failures)


def test_no_import_cycles_in_the_backend() -> None:
    graph = without_package_inits(import_graph())
    assert any(n.startswith("hp_dtensor.platform.mindspore.") for n in graph), sorted(graph)
    found = [c for c in cycles(graph) if any(n.startswith("hp_dtensor.platform.mindspore") for n in c)]
    assert found == [], found
