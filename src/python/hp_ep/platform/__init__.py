"""Expert parallelism's framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``EP`` (``hp_ep.primitives.EPPrimitives``); everything else
in ``hp_ep`` is framework-neutral.
"""

from __future__ import annotations

from types import ModuleType

from hp_dtensor.platform import package_backend


def framework_module(feature: str) -> ModuleType:
    """``hp_ep.platform.<framework>`` for the selected framework; ``NotImplementedError`` naming
    ``feature`` where hp_ep has no code for it."""
    return package_backend("hp_ep", feature)
