"""The import graph of a package's source files, and its loops.

Every ``import`` of a module of the package anywhere in a file (top level, inside functions, under
``TYPE_CHECKING``) is an edge, as Pants infers dependencies: a function-level import hides a loop
from Python but not from the build.  Used by the tests that keep hp_dtensor free of import loops.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import hp_dtensor

ROOT = Path(hp_dtensor.__file__).parent


def module_names() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def _path_of(name: str) -> Path:
    base = ROOT.parent.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imported(name: str, tree: ast.AST, known: set[str]) -> Iterator[str]:
    """hp_dtensor modules ``name``'s source imports (``from pkg import sub`` names the submodule)."""
    is_pkg = _path_of(name).name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = name.split(".") if is_pkg else name.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - node.level + 1]
                mod = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in known:
                    yield sub
                elif mod in known:
                    yield mod


def import_graph() -> dict[str, set[str]]:
    known = set(module_names())
    graph: dict[str, set[str]] = {}
    for name in sorted(known):
        tree = ast.parse(_path_of(name).read_text())
        # A package's own __init__ re-exporting its submodules is not a loop with them: Python
        # runs the parent first by construction.  Edges into a package __init__ from its own
        # submodules are kept (that is a loop).
        graph[name] = {m for m in _imported(name, tree, known) if m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop a package ``__init__``'s edges to its own submodules (re-exports): Python imports the
    parent package first, so those edges never run in a loop; the loop that matters is between
    sibling modules."""
    return {v: {w for w in ws if not w.startswith(v + ".")} for v, ws in graph.items()}
