"""``Configurable``: a class built from its nested ``Config`` dataclass.

Every subclass that declares a ``Config`` gets it bound (``Config._owner``), so
``SomeModule.Config(dim=8).build(device=...)`` constructs ``SomeModule(config, device=...)``.
Configs are ``@dataclass(kw_only=True, slots=True)``: keyword-only so subclasses can add fields
after defaulted ones, slotted so typos raise instead of silently adding attributes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import Any, ClassVar

from hp_dtensor.placement_types import Placement


class Configurable:
    """Base of everything built from a Config."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        _owner: ClassVar[type[Configurable] | None] = None

        def build(self, **runtime_kwargs: Any) -> Any:
            """Construct the owning class: ``Owner(self, **runtime_kwargs)``."""
            owner: Any = type(self)._owner
            if owner is None:
                raise TypeError(f"{type(self).__qualname__} is not bound to a Configurable class")
            clash = sorted(set(runtime_kwargs) & {f.name for f in dataclasses.fields(self)})
            if clash:
                raise TypeError(
                    f"{type(self).__qualname__}.build(): runtime argument(s) {clash} collide with config "
                    f"fields; set them on the config (config.replace({clash[0]}=...)) instead"
                )
            return owner(self, **runtime_kwargs)

        def replace(self, **changes: Any) -> Any:
            """A copy with ``changes`` applied; the original is untouched."""
            names = {f.name for f in dataclasses.fields(self)}
            unknown = sorted(set(changes) - names)
            if unknown:
                raise TypeError(f"{type(self).__qualname__} has no field(s) {unknown}; fields are {sorted(names)}")
            return dataclasses.replace(self, **changes)

        def traverse(self, prefix: str = "") -> Iterator[tuple[str, Configurable.Config]]:
            """This config and every nested config (in fields, lists, tuples, dicts), with dotted paths."""
            yield prefix, self
            for f in dataclasses.fields(self):
                yield from _traverse_value(getattr(self, f.name), f"{prefix}.{f.name}" if prefix else f.name)

        def to_dict(self) -> dict[str, Any]:
            """Plain nested dicts/lists/scalars (YAML-dumpable); nested configs included."""
            return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config = cls.__dict__.get("Config")
        if config is None:
            return
        _check_config(cls, config)
        config._owner = cls


def _check_config(owner: type, config: type) -> None:
    name = f"{owner.__qualname__}.Config"
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"{name} must be a @dataclass(kw_only=True, slots=True)")
    if "__slots__" not in config.__dict__:
        raise TypeError(f"{name} must be declared with @dataclass(kw_only=True, slots=True): it has no __slots__")
    for f in dataclasses.fields(config):
        if not f.kw_only:
            raise TypeError(
                f"{name}.{f.name} is not keyword-only: declare {name} with @dataclass(kw_only=True, slots=True)"
            )


def _traverse_value(value: Any, path: str) -> Iterator[tuple[str, Configurable.Config]]:
    if isinstance(value, Configurable.Config):
        yield from value.traverse(path)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _traverse_value(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _traverse_value(v, f"{path}[{k!r}]")


def _plain(value: Any) -> Any:
    if isinstance(value, Configurable.Config):
        return value.to_dict()
    if isinstance(value, Placement):
        return repr(value)  # "Shard(dim=0)": readable, and a string YAML can hold
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)  # placements, dtypes: readable and loadable as strings
