"""``import_each_alone`` fails a module whose import only works in some order, and refuses a
preload that loads the package (the children would not start clean)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hp_dtensor.testing.import_graph import import_each_alone


def _package(root: Path) -> None:
    pkg = root / "loopy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # a imports b, b needs a name a defines only after its import of b: importing b first works
    # (a runs to the end inside it), importing a first fails
    (pkg / "a.py").write_text("from loopy import b\nVALUE = 1\n")
    (pkg / "b.py").write_text("from loopy.a import VALUE\n")
    (pkg / "c.py").write_text("X = 2\n")


def test_an_order_dependent_loop_fails_only_where_it_bites(tmp_path: Path) -> None:
    _package(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    found = import_each_alone(["loopy", "loopy.a", "loopy.b", "loopy.c"], package="loopy", preload=("json",), env=env)
    assert sorted(found) == ["loopy.a"], found
    assert "ImportError" in found["loopy.a"], found["loopy.a"]


def test_a_preload_that_loads_the_package_is_a_failure(tmp_path: Path) -> None:
    _package(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    found = import_each_alone(["loopy.c"], package="loopy", preload=("loopy.c",), env=env)
    assert list(found) == ["<preload>"] and "loopy.c" in found["<preload>"], found
