"""Every kernel a sharding rule names (``Decision.kernel``) is one a backend supplies.

Rules name kernels by string, so a misspelt or forgotten kernel would surface only as a
``KeyError`` in the op that reaches it.  Here, where both backends' sources are at hand: the
names the rule modules pass as ``kernel=`` against the kernels MindSpore registers (imported)
and torch registers (read from its ``kernels.py``, so torch's dispatch is not imported here).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hp_dtensor
from hp_dtensor.platform.mindspore.dispatch import KERNELS

_SRC = Path(hp_dtensor.__file__).parent


def _named_kernels() -> set[str]:
    """The string literals the rule modules pass as ``kernel`` or ``kernel_name``."""
    found = set()
    for path in sorted((_SRC / "sharding").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    value = kw.value.value if isinstance(kw.value, ast.Constant) else None
                    if kw.arg in ("kernel", "kernel_name") and isinstance(value, str):
                        found.add(value)
    return found


def _torch_kernels() -> set[str]:
    """The names torch's ``kernels.py`` registers with ``@kernel("...")``."""
    names = set()
    for node in ast.walk(ast.parse((_SRC / "platform" / "torch" / "kernels.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "kernel":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
    return names


def test_every_kernel_a_rule_names_is_supplied_by_a_backend() -> None:
    import hp_dtensor.platform.mindspore  # noqa: F401  (registers MindSpore's kernels)

    named, ms, torch_ = _named_kernels(), set(KERNELS), _torch_kernels()
    print(f"rules name {len(named)} kernels; MindSpore supplies {len(ms)}, torch {len(torch_)}")
    assert len(named) >= 5 and len(torch_) >= 8, "the scans found too little: they are broken"
    assert named <= ms | torch_, f"kernels no backend supplies: {sorted(named - ms - torch_)}"
    assert "masked_embedding" in ms & torch_
