"""``CommDebugMode``: count the collectives this library issues, by kind and by module.

The platform's collective functions call ``record`` for every collective; a mode that is active
(``with CommDebugMode() as comm:``) counts it.  Counts are what tests assert on: timings never are.
Pure: no framework import.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from types import TracebackType
from typing import Any

_state = threading.local()


def _modes() -> list[CommDebugMode]:
    if not hasattr(_state, "modes"):
        _state.modes = []
        _state.module_stack = []
    return _state.modes


def _module_stack() -> list[str]:
    _modes()
    return _state.module_stack  # type: ignore[no-any-return]


def record(kind: str, nbytes: int, group_size: int | None = None) -> None:
    """Called by the platform for every collective it runs (kind: all_reduce, all_gather, ...);
    ``nbytes`` is the collective's buffer (the gathered output for all_gather, the input for the
    others), ``group_size`` the number of ranks taking part, when known."""
    modes = _modes()
    if not modes:
        return
    stack = _module_stack()
    fqn = stack[-1] if stack else None
    for mode in modes:
        mode._record(kind, nbytes, fqn, group_size)


def push_module(fqn: str) -> None:
    _module_stack().append(fqn)


def pop_module(fqn: str) -> None:
    stack = _module_stack()
    if stack and stack[-1] == fqn:
        stack.pop()


class CommDebugMode:
    """Context manager counting collectives by kind (``get_comm_counts``), total
    (``get_total_counts``), bytes (``get_comm_bytes``) and, for modules attached with
    ``track_module``, by the innermost running module's FQN (``get_comm_counts_by_module``)."""

    def __init__(self) -> None:
        self.comm_counts: Counter[str] = Counter()
        self.comm_bytes: Counter[str] = Counter()
        self.comm_module_counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.comm_log: list[tuple[str, int, int | None]] = []  # (kind, bytes, group size) in order

    def _record(self, kind: str, nbytes: int, fqn: str | None, group_size: int | None = None) -> None:
        self.comm_log.append((kind, nbytes, group_size))
        self.comm_counts[kind] += 1
        self.comm_bytes[kind] += nbytes
        if fqn is not None:
            self.comm_module_counts[fqn][kind] += 1

    def get_comm_counts(self) -> dict[str, int]:
        return dict(self.comm_counts)

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_comm_bytes(self) -> dict[str, int]:
        return dict(self.comm_bytes)

    def get_comm_counts_by_module(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.comm_module_counts.items()}

    def reset(self) -> None:
        self.comm_counts.clear()
        self.comm_bytes.clear()
        self.comm_module_counts.clear()
        self.comm_log.clear()

    def track_module(self, module: Any) -> None:
        """Attribute collectives issued while a submodule's forward runs to its FQN (the root's
        as ``<root>``)."""
        from hp_dtensor.platform import current

        plat = current()
        for fqn, sub in plat.named_modules(module):
            name = fqn or "<root>"
            plat.register_forward_pre_hook(sub, lambda _m, _a, _n=name: push_module(_n))
            plat.register_forward_hook(sub, lambda _m, _a, _o, _n=name: pop_module(_n))

    def __enter__(self) -> CommDebugMode:
        _modes().append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _modes().remove(self)
