"""``ModelSpec``: everything a trainer needs to build and parallelize a model, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hp_protocols.model import BaseModel
from hp_protocols.state_dict_adapter import BaseStateDictAdapter


@dataclass(kw_only=True)
class ModelSpec:
    """v1 fields (``name``, ``build_model_fn``, ``parallelize_fn``, ``pipelining_fn``,
    ``state_dict_adapter``) plus ``model``: a ``BaseModel.Config`` to build from.  Exactly one of
    ``build_model_fn`` and ``model`` is given."""

    name: str
    build_model_fn: Callable[..., Any] | None = None
    model: BaseModel.Config | None = None
    parallelize_fn: Callable[..., Any] | None = None
    pipelining_fn: Callable[..., Any] | None = None
    state_dict_adapter: type[BaseStateDictAdapter] | None = None

    def __post_init__(self) -> None:
        if (self.build_model_fn is None) == (self.model is None):
            raise ValueError(
                f"ModelSpec {self.name!r}: give exactly one of build_model_fn and model "
                f"(got {'both' if self.model is not None else 'neither'})"
            )

    def build(self, **runtime_kwargs: Any) -> Any:
        if self.model is not None:
            return self.model.build(**runtime_kwargs)
        assert self.build_model_fn is not None
        return self.build_model_fn(**runtime_kwargs)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"a model spec named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no model spec named {name!r}; registered: {sorted(_REGISTRY)}") from None
