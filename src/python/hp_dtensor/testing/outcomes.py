"""What a call did, as text a test compares across ranks: ``"no error"`` or ``"<Type>: <message>"``.

Fail-closed tests assert that every rank raises the same exception type and message; recording
each outcome as one string keeps the comparison to a list equality."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def outcome(call: Callable[[], object]) -> str:
    """Run ``call``; ``"no error"`` or the exception it raised, type name first."""
    try:
        call()
    except Exception as e:  # noqa: BLE001  (the type is part of what is recorded)
        return f"{type(e).__name__}: {e}"
    return "no error"


def outcomes(calls: Iterable[Callable[[], object]]) -> list[str]:
    """``outcome`` of each call, in order."""
    return [outcome(call) for call in calls]
