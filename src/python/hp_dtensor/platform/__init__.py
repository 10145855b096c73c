"""The platform layer: the only code that imports a framework.

``current()`` returns the backend module selected by ``HYPER_PARALLEL_PLATFORM`` (``torch`` or
``mindspore``), else the installed framework (torch first).  Everything framework-specific the
core needs -- process groups, collectives, the DTensor tensor subclass and its op dispatch,
modules and hooks -- is reached through it; ``platform.base.Backend`` is that contract.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from hp_dtensor.platform.base import Backend

_KNOWN = ("torch", "mindspore")


def platform_name() -> str:
    """Name of the selected framework; raises ``ImportError`` saying what to install."""
    name = os.environ.get("HYPER_PARALLEL_PLATFORM", "").strip().lower()
    if name:
        if name not in _KNOWN:
            raise ValueError(f"HYPER_PARALLEL_PLATFORM={name!r} is not one of {_KNOWN}")
        if importlib.util.find_spec(name) is None:
            raise ImportError(
                f"HYPER_PARALLEL_PLATFORM={name} but {name} is not installed; "
                f"install it (pip install torch==2.13.0 / mindspore==2.10.0) or unset the variable"
            )
        return name
    for candidate in _KNOWN:
        if importlib.util.find_spec(candidate) is not None:
            return candidate
    raise ImportError(
        "hyper-parallel needs a framework: install torch (pip install torch==2.13.0) "
        "or mindspore (pip install mindspore==2.10.0)"
    )


@lru_cache(maxsize=1)
def current() -> Backend:
    """The backend module (``hp_dtensor.platform.torch`` or ``...mindspore``), typed by the
    backend contract (``platform.base.Backend``) that each backend is checked against."""
    from hp_dtensor.platform.base import contract_gaps

    name = platform_name()
    backend = importlib.import_module(f"hp_dtensor.platform.{name}")
    gaps = contract_gaps(backend)
    if gaps:
        raise ImportError(f"the {name} backend does not meet the backend contract: {gaps}")
    return cast("Backend", backend)


def backend_primitives(name: str, feature: str, instead: str) -> Any:
    """The primitives object ``name`` (``RNG``, ``FSDP``, ``GRAD_NORM``...) the selected backend
    exports for one feature; ``NotImplementedError`` naming the backend and what to do ``instead``
    when it has none.  Callers type the result with the feature's own Protocol."""
    prims = getattr(current(), name, None)
    if prims is None:
        raise NotImplementedError(f"{feature} is not supported on the {current().NAME} backend yet; {instead}")
    return prims
