"""``fully_shard``'s framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``FSDP`` (``hp_fsdp.primitives.FSDPPrimitives``) and
``GRAD_NORM`` (``hp_fsdp.norm_primitives.GradNormPrimitives``); everything else in ``hp_fsdp`` is
framework-neutral.
"""

from __future__ import annotations

from types import ModuleType

from hp_dtensor.platform import package_backend


def framework_module(feature: str) -> ModuleType:
    """``hp_fsdp.platform.<framework>`` for the selected framework; ``NotImplementedError`` naming
    ``feature`` where hp_fsdp has no code for it."""
    return package_backend("hp_fsdp", feature)
