"""Cells, parameters and hooks on MindSpore: what the styles and ``distribute_module`` use.

MindSpore's ``Cell.register_forward_pre_hook(hook, with_kwargs=...)`` and
``register_forward_hook`` take torch's signatures; a pre-hook that changes inputs must return a
tuple (``(args, kwargs)`` with kwargs), which is why every style's input hook returns one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mindspore as ms
from mindspore import Tensor, mint, nn

from hp_dtensor.platform.mindspore.dtensor import DTensor, as_parameter

Module = nn.Cell
ModuleList = nn.CellList
ModuleDict = nn.CellDict
Sequential = nn.SequentialCell
Parameter = ms.Parameter

_LINEAR = (nn.Dense, mint.nn.Linear)
_EMBEDDING = (nn.Embedding, mint.nn.Embedding)


def numel(t: Any) -> int:
    n = 1
    for s in t.shape:
        n *= int(s)
    return n


def is_module(obj: Any) -> bool:
    return isinstance(obj, nn.Cell)


def is_linear_module(m: Any) -> bool:
    """``nn.Dense`` (weight ``[out, in]``, like torch's Linear) and ``mint.nn.Linear``."""
    return isinstance(m, _LINEAR)


def is_embedding_module(m: Any) -> bool:
    return isinstance(m, _EMBEDDING)


def is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def named_children(m: nn.Cell) -> Iterator[tuple[str, nn.Cell]]:
    return iter(m.name_cells().items())


def named_modules(m: nn.Cell) -> Iterator[tuple[str, nn.Cell]]:
    return iter(m.cells_and_names())


def direct_params(m: nn.Cell) -> list[tuple[str, Any]]:
    return list(m._params.items())


def direct_buffers(m: nn.Cell) -> list[tuple[str, Any]]:
    return list(getattr(m, "_buffers", {}).items())


def set_param(m: nn.Cell, name: str, value: DTensor) -> None:
    """Replace parameter ``name`` by a ``Parameter`` holding ``value`` (a DTensor), keeping its
    name and requires_grad."""
    setattr(m, name, as_parameter(value, m._params[name]))


def share_param(m: nn.Cell, name: str, param: Any) -> None:
    """Make ``m.<name>`` the very ``Parameter`` object ``param`` (already held by another cell),
    so tied weights stay one parameter."""
    setattr(m, name, param)


def set_buffer(m: nn.Cell, name: str, value: Any) -> None:
    m._buffers[name] = value


def register_forward_pre_hook(m: nn.Cell, hook: Callable[..., Any], *, with_kwargs: bool = False) -> Any:
    return m.register_forward_pre_hook(hook, with_kwargs=with_kwargs)


def register_forward_hook(m: nn.Cell, hook: Callable[..., Any]) -> Any:
    return m.register_forward_hook(hook)


def track_module_forward(root: nn.Cell, push: Callable[[str], None], pop: Callable[[str], None]) -> None:
    for fqn, sub in root.cells_and_names():
        name = fqn or "<root>"
        sub.register_forward_pre_hook(lambda _m, _a, _n=name: push(_n))
        sub.register_forward_hook(lambda _m, _a, _o, _n=name: pop(_n))
