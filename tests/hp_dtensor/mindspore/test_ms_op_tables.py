"""Every kernel a sharding rule names (``Decision.kernel``) is one a backend supplies.

Rules name kernels by string, so a misspelt or forgotten kernel would surface only as a
``KeyError`` in the op that reaches it.  Here, where both backends' sources are at hand: the
names the rule modules give (read from their syntax) against the kernels MindSpore registers
(imported) and torch registers (read from its ``kernels.py``; torch's dispatch is not imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hp_dtensor
from hp_dtensor.platform.mindspore.dispatch import KERNELS

_SRC = Path(hp_dtensor.__file__).parent


def _kernel_names(node: ast.expr | None) -> tuple[set[str], set[str]]:
    """``(names, prefixes)`` a kernel expression can give: a string, an f-string's leading text,
    either side of a conditional (None gives nothing)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}, set()
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return set(), {str(node.values[0].value)}
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.FormattedValue):
        inner = node.values[0].value  # f"{SCALAR_ONCE}{pos}": the prefix is a module constant
        if isinstance(inner, ast.Name) and inner.id == "SCALAR_ONCE":
            from hp_dtensor.sharding.pointwise import SCALAR_ONCE

            return set(), {SCALAR_ONCE}
    if isinstance(node, ast.IfExp):
        a, b = _kernel_names(node.body), _kernel_names(node.orelse)
        return a[0] | b[0], a[1] | b[1]
    return set(), set()


def _named_kernels() -> tuple[set[str], set[str]]:
    """The kernels the rule modules name: as ``kernel=`` (or ``kernel_name=``) of a call, as
    ``keeps_uneven``'s third argument, or assigned to a variable named ``kernel``."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for path in sorted((_SRC / "sharding").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[ast.expr] = []
            if isinstance(node, ast.Call):
                found += [kw.value for kw in node.keywords if kw.arg in ("kernel", "kernel_name")]
                if isinstance(node.func, ast.Name) and node.func.id == "keeps_uneven" and len(node.args) > 2:
                    found.append(node.args[2])
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "kernel" for t in node.targets):
                found.append(node.value)
            for expr in found:
                n, p = _kernel_names(expr)
                names |= n
                prefixes |= p
    return names, prefixes


def _torch_kernels() -> tuple[set[str], set[str]]:
    """The names (and f-string families) torch's ``kernels.py`` registers with ``kernel(...)``."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for node in ast.walk(ast.parse((_SRC / "platform" / "torch" / "kernels.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "kernel" and node.args:
            n, p = _kernel_names(node.args[0])
            names |= n
            prefixes |= p
    return names, prefixes


def test_every_kernel_a_rule_names_is_supplied_by_a_backend() -> None:
    import hp_dtensor.platform.mindspore  # noqa: F401  (registers MindSpore's kernels)

    (named, prefixes), ms, (torch_, torch_families) = _named_kernels(), set(KERNELS), _torch_kernels()
    print(f"rules name {len(named)} kernels and {len(prefixes)} families; MindSpore supplies {len(ms)}, "
          f"torch {len(torch_)} and {len(torch_families)} families")
    assert len(named) >= 10 and len(prefixes) >= 2, "the scans found too little: they are broken"
    # (a rule shared by both backends is checked against either: which backend's ops reach it
    # is the tables' business, and each backend raises KeyError naming a kernel it lacks)
    assert named <= ms | torch_, f"kernels no backend supplies: {sorted(named - ms - torch_)}"
    for prefix in prefixes:
        assert any(k.startswith(prefix) for k in ms | torch_ | torch_families), f"no backend has a {prefix}* kernel"
    assert {"masked_embedding", "vector_norm", "dropout"} <= named
    assert "masked_embedding" in ms & torch_
