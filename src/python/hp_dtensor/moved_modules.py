"""Import paths that moved keep working for one minor version, with a ``DeprecationWarning``.

A package registers its moved modules from its ``__init__`` (which Python imports before any of
its submodules): importing an old name then imports the new module and binds it under both names,
so ``from old.path import name`` and ``import old.path`` keep working.  A module that moved into
another distribution that is not installed raises ``ModuleNotFoundError`` naming what to install.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Moved:
    """Where a module went: its new dotted path, the distribution that ships it, and the version
    that removes the old path."""

    new: str
    distribution: str
    removed_in: str


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.moves: dict[str, Moved] = {}
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moves:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        move = self.moves[spec.name]
        warnings.warn(
            f"{spec.name} moved to {move.new}; import it from there ({spec.name} is removed in "
            f"{move.removed_in})",
            DeprecationWarning,
            stacklevel=2,
        )
        try:
            module = importlib.import_module(move.new)
        except ModuleNotFoundError as exc:
            if exc.name is not None and move.new.startswith(exc.name):
                raise ModuleNotFoundError(
                    f"{spec.name} moved to {move.new}, which is in the {move.distribution} "
                    f"distribution: pip install {move.distribution}",
                    name=spec.name,
                ) from exc
            raise
        # Python stamps the old name's spec on whatever this returns; exec_module puts it back.
        self.specs[move.new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module is the new one, already executed: only its own spec is restored.
        module.__spec__ = self.specs[module.__name__]


_FINDER = _MovedFinder()


def register_moved(moves: Mapping[str, Moved]) -> None:
    """Make each old dotted path in ``moves`` import its new module (idempotent)."""
    _FINDER.moves.update(moves)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
