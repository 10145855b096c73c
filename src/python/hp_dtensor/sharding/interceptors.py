"""Op interceptors: how a feature built on the DTensor takes over some ops while its context is active.

Loss parallel (in hp_tp) pushes an interceptor ``(op, args, kwargs) -> call-or-None`` on entering
its context and pops it on exit; the backend's dispatch asks the active interceptors, innermost
first, before any rule, and runs the call one returns.  The stack is per thread, so outside such a
context the check is one attribute read (``getattr(INTERCEPTORS, "stack", None)`` is None).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

OpInterceptor = Callable[[Any, tuple[Any, ...], dict[str, Any]], Callable[[], Any] | None]
INTERCEPTORS = threading.local()


def push_interceptor(fn: OpInterceptor) -> None:
    stack = getattr(INTERCEPTORS, "stack", None)
    INTERCEPTORS.stack = (stack or ()) + (fn,)


def pop_interceptor(fn: OpInterceptor) -> None:
    stack = INTERCEPTORS.stack
    if not stack or stack[-1] is not fn:
        raise RuntimeError("DTensor op interceptors were popped out of order")
    INTERCEPTORS.stack = stack[:-1] or None


def intercepting() -> bool:
    """Whether some interceptor is active on this thread."""
    return getattr(INTERCEPTORS, "stack", None) is not None
