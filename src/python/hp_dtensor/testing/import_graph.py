"""The import graph of a package's source files, and its loops.

Every ``import`` of a module of the package anywhere in a file (top level, inside functions, under
``TYPE_CHECKING``) is an edge, as Pants infers dependencies: a function-level import hides a loop
from Python but not from the build.  Used by the tests that keep hp_dtensor free of import loops.

``import_each_alone`` imports each module first thing in an interpreter that holds no module of
the package, as a fresh one would; one interpreter loads the heavy third-party frameworks once and
forks a child per module, instead of paying their import per module.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
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


# Run by one fresh interpreter: import the preloads, check that they loaded nothing of the package,
# then per module fork a child that imports it and reports its traceback through a pipe.
_FORK_EACH = r"""
import json, os, signal, sys, traceback
names, preload, package, timeout_s, out_path = json.loads(sys.argv[1])
for mod in preload:
    __import__(mod)
loaded = sorted(m for m in sys.modules if m == package or m.startswith(package + "."))
failures = {}
if loaded:
    failures["<preload>"] = f"importing {preload} loaded modules of {package}: {loaded}"
    names = []
for name in names:
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(int(timeout_s))
        code = 0
        try:
            __import__(name)
            msg = b""
        except BaseException:
            msg, code = traceback.format_exc().encode(), 1
        os.write(w, msg[-8000:])
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failures[name] = msg or f"the child died (wait status {status})"
with open(out_path, "w") as f:
    json.dump(failures, f)
"""


def import_each_alone(names: list[str], *, package: str = "hp_dtensor", preload: tuple[str, ...] = (),
                      env: dict[str, str] | None = None, timeout_s: float = 120.0) -> dict[str, str]:
    """Import each of ``names`` as the first module of ``package`` loaded in its interpreter; returns
    ``{name: traceback}`` for those that fail.

    ``preload`` (third-party modules such as ``torch``) is imported once and the interpreter forks
    per module, so every child starts with those loaded and nothing of ``package``, exactly the
    state in which a fresh ``python -c "import name"`` reaches its first import of the package (a
    preload that imports the package is reported as a failure).  Without ``os.fork`` each module
    gets its own interpreter."""
    run_env = {**os.environ, **(env or {})}
    if not hasattr(os, "fork"):
        failures = {}
        for name in names:
            proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                                  env=run_env, timeout=timeout_s)
            if proc.returncode != 0:
                failures[name] = proc.stderr[-2000:]
        return failures
    with tempfile.TemporaryDirectory(prefix="hp-import-each-") as tmp:
        out = os.path.join(tmp, "failures.json")
        arg = json.dumps([names, list(preload), package, timeout_s, out])
        proc = subprocess.run([sys.executable, "-c", _FORK_EACH, arg], capture_output=True, text=True, env=run_env,
                              timeout=timeout_s * (len(names) + 1))
        if proc.returncode != 0 or not os.path.exists(out):
            return {"<interpreter>": f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"}
        with open(out) as f:
            return dict(json.load(f))
