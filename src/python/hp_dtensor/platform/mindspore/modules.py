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

# The method a cell's call runs (a protocol Module wraps it to reshard inputs and outputs).
FORWARD = "construct"

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


def init_param_(param: Any, kind: str, std: float = 0.02) -> None:
    """Initialize in place: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones`` (MindSpore's
    initializers, seeded by ``mindspore.set_seed``)."""
    from mindspore.common import initializer as init

    if kind == "normal":
        how: Any = init.Normal(sigma=std, mean=0.0)
    elif kind == "zeros":
        how = init.Zero()
    elif kind == "ones":
        how = init.One()
    else:
        raise ValueError(f"unknown init kind {kind!r}; use normal, zeros or ones")
    param.set_data(init.initializer(how, tuple(param.shape), param.dtype).init_data())


def parameters(m: nn.Cell) -> list[Any]:
    """Every parameter of the tree, each once."""
    return list(m.get_parameters())


def register_param(m: nn.Cell, name: str, param: Any) -> None:
    # The parameter keeps the name it has (a state dict key), unlike ``setattr`` on a fresh one.
    m.insert_param_to_cell(name, param, check_name_contain_dot=False)


def register_buffer(m: nn.Cell, name: str, value: Any) -> None:
    m.register_buffer(name, value)


def add_child(m: nn.Cell, name: str, child: nn.Cell) -> None:
    m.insert_child_to_cell(name, child)


def state_dict(m: nn.Cell) -> dict[str, Any]:
    """Parameters and buffers by dotted path (the cell attribute path, as torch names them)."""
    out: dict[str, Any] = {}
    for fqn, cell in m.cells_and_names():
        prefix = f"{fqn}." if fqn else ""
        for name, p in list(cell._params.items()) + list(getattr(cell, "_buffers", {}).items()):
            if p is not None and f"{prefix}{name}" not in out:
                out[f"{prefix}{name}"] = p
    return out


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

