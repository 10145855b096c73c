"""Context parallelism's framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``CP`` (``hp_cp.primitives.CPPrimitives``); everything
else in ``hp_cp`` is framework-neutral.  On a framework without a folder, using context
parallelism raises ``NotImplementedError`` naming it.
"""

from __future__ import annotations

from types import ModuleType

from hp_dtensor.platform import package_backend


def framework_module(feature: str) -> ModuleType:
    """``hp_cp.platform.<framework>`` for the selected framework; ``NotImplementedError`` naming
    ``feature`` where hp_cp has no code for it."""
    return package_backend("hp_cp", feature)
