"""Module-level hooks and type checks the styles and ``distribute_module`` use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

Module = nn.Module
ModuleList = nn.ModuleList
ModuleDict = nn.ModuleDict
Sequential = nn.Sequential
Parameter = nn.Parameter

# The method a module's call runs (a protocol Module wraps it to reshard inputs and outputs).
FORWARD = "forward"


def init_param_(param: Any, kind: str, std: float = 0.02) -> None:
    """Initialize in place: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones``."""
    with torch.no_grad():
        if kind == "normal":
            param.normal_(0.0, std)
        elif kind == "zeros":
            param.zero_()
        elif kind == "ones":
            param.fill_(1.0)
        else:
            raise ValueError(f"unknown init kind {kind!r}; use normal, zeros or ones")


def numel(t: Any) -> int:
    return int(t.numel())


def is_module(obj: Any) -> bool:
    return isinstance(obj, nn.Module)


def is_linear_module(m: Any) -> bool:
    return isinstance(m, nn.Linear)


def is_embedding_module(m: Any) -> bool:
    return isinstance(m, nn.Embedding)


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def named_children(m: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return m.named_children()


def named_modules(m: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return m.named_modules()


def parameters(m: nn.Module) -> list[Any]:
    """Every parameter of the tree, each once."""
    return list(m.parameters())


def register_param(m: nn.Module, name: str, param: Any) -> None:
    m.register_parameter(name, param)


def register_buffer(m: nn.Module, name: str, value: Any) -> None:
    m.register_buffer(name, value)


def add_child(m: nn.Module, name: str, child: nn.Module) -> None:
    m.add_module(name, child)


def state_dict(m: nn.Module) -> dict[str, Any]:
    """Parameters and persistent buffers by dotted name (the objects themselves, not detached copies)."""
    return dict(m.state_dict(keep_vars=True))


def direct_params(m: nn.Module) -> list[tuple[str, Any]]:
    return list(m._parameters.items())


def direct_buffers(m: nn.Module) -> list[tuple[str, Any]]:
    return list(m._buffers.items())


def set_param(m: nn.Module, name: str, value: Any) -> None:
    """Replace parameter ``name`` by ``value`` (a DTensor), keeping requires_grad."""
    old = m._parameters[name]
    requires_grad = old.requires_grad if old is not None else True
    m.register_parameter(name, nn.Parameter(value, requires_grad=requires_grad))


def share_param(m: nn.Module, name: str, param: Any) -> None:
    """Make ``m.<name>`` the very parameter object ``param`` (already registered elsewhere), so
    tied weights stay one parameter: one storage, one ``.grad`` that sums both uses."""
    m.register_parameter(name, param)


def set_buffer(m: nn.Module, name: str, value: Any) -> None:
    m._buffers[name] = value


def register_forward_pre_hook(m: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> Any:
    return m.register_forward_pre_hook(hook, with_kwargs=with_kwargs)


def register_forward_hook(m: nn.Module, hook: Callable[..., Any]) -> Any:
    return m.register_forward_hook(hook)

