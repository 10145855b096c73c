"""hp_dtensor has no import loops, and every module imports on its own.

Statically: every import of an hp_dtensor module anywhere in a file is an edge
(``hp_dtensor.testing.import_graph``); the graph must have no cycle.  At run time: each module is
imported alone, as the first module of the package in its interpreter (one interpreter imports
torch once and forks a child per module), so a loop that only bites in some import order fails
here with its ImportError instead of in a user's program.  The MindSpore backend's modules are imported
alone by the MindSpore suite (they need its resolve); its files are in the static graph here.
"""

from __future__ import annotations

import os
import sys

from hp_dtensor.testing.import_graph import (
    cycles,
    import_each_alone,
    import_graph,
    module_names,
    without_package_inits,
)

MINDSPORE_BACKEND = "hp_dtensor.platform.mindspore"


def test_no_import_cycles() -> None:
    graph = without_package_inits(import_graph())
    found = cycles(graph)
    print(f"modules: {len(graph)}, import edges: {sum(len(v) for v in graph.values())}, cycles: {len(found)}")
    # The whole package must be here (under Pants, only what the test depends on is in the sandbox).
    assert any(n.startswith("hp_dtensor.platform.torch.") for n in graph) and len(graph) > 40, sorted(graph)
    assert found == [], "import loops between hp_dtensor modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_each_module_imports_alone() -> None:
    names = [n for n in module_names() if not n.startswith(MINDSPORE_BACKEND)]
    env = {"PYTHONPATH": os.pathsep.join(sys.path), "HYPER_PARALLEL_PLATFORM": "torch"}
    found = import_each_alone(names, preload=("torch",), env=env)
    failures = [f"{name}:\n{err[-2000:]}" for name, err in found.items()]
    print(f"modules imported alone: {len(names)}, failed: {len(failures)}")
    assert len(names) > 40 and failures == [], "\n".join(failures)
