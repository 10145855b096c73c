"""The DTensor's platform layer, and how every package finds its own framework code.

``current()`` returns the DTensor backend module selected by ``HYPER_PARALLEL_PLATFORM``
(``torch`` or ``mindspore``), else the installed framework (torch first).  What the DTensor needs
from a framework -- process groups, collectives, the tensor subclass and its op dispatch, RNG,
modules and hooks -- is reached through it; ``hp_dtensor.backend_contract.Backend`` is that contract.

A package above the DTensor keeps the framework calls of its own features (``fully_shard``'s flat
buffers, loss parallel's interception, checkpoint file formats) in its own
``<package>/platform/<framework>/`` folder behind a Protocol it defines, found with
``package_backend``: a fix there is a release of that package alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import cache, lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from hp_dtensor.backend_contract import Backend

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
    backend contract (``hp_dtensor.backend_contract.Backend``) that each backend is checked against."""
    from hp_dtensor.backend_contract import contract_gaps

    name = platform_name()
    backend = importlib.import_module(f"hp_dtensor.platform.{name}")
    gaps = contract_gaps(backend)
    if gaps:
        raise ImportError(f"the {name} backend does not meet the backend contract: {gaps}")
    return cast("Backend", backend)


def backend_primitives(name: str, feature: str, instead: str) -> Any:
    """The primitives object ``name`` (``RNG``) the selected backend
    exports for one feature; ``NotImplementedError`` naming the backend and what to do ``instead``
    when it has none.  Callers type the result with the feature's own Protocol."""
    prims = getattr(current(), name, None)
    if prims is None:
        raise NotImplementedError(f"{feature} is not supported on the {current().NAME} backend yet; {instead}")
    return prims


@cache
def package_backend(package: str, feature: str) -> ModuleType:
    """``<package>.platform.<framework>`` for the selected framework: the primitives ``package``
    implements for it.  A package without code for that framework raises ``NotImplementedError``
    naming the ``feature`` and the framework, so a user learns what is missing, not a module name."""
    name = platform_name()
    module = f"{package}.platform.{name}"
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        others = [n for n in _KNOWN if n != name and importlib.util.find_spec(f"{package}.platform.{n}")]
        instead = f"; it runs on {', '.join(others)} (HYPER_PARALLEL_PLATFORM={others[0]})" if others else ""
        raise NotImplementedError(f"{feature} is not supported on the {name} backend yet{instead}")
    return importlib.import_module(module)
