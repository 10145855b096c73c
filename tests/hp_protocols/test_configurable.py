# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Configurable / Config: owner binding, build, replace, traverse, to_dict, and the strict rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml

from hp_dtensor import Shard
from hp_protocols import Configurable, MeshAxisName, ShardingConfig


class Inner(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        width: int = 4

    def __init__(self, config: Config, *, scale: int = 1) -> None:
        self.config, self.scale = config, scale


class Outer(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        name: str = "outer"
        inner: Inner.Config = dataclasses.field(default_factory=Inner.Config)
        blocks: list[Inner.Config] = dataclasses.field(default_factory=list)
        sharding: ShardingConfig | None = None

    def __init__(self, config: Config) -> None:
        self.config = config


def test_owner_is_bound_and_build_constructs_it() -> None:
    assert Inner.Config._owner is Inner and Outer.Config._owner is Outer
    obj = Inner.Config(width=8).build(scale=3)
    assert isinstance(obj, Inner) and obj.config.width == 8 and obj.scale == 3


def test_build_rejects_runtime_kwargs_that_collide_with_fields() -> None:
    with pytest.raises(TypeError, match=r"\['width'\] collide"):
        Inner.Config().build(width=3)


def test_replace_copies() -> None:
    a = Inner.Config(width=2)
    b = a.replace(width=5)
    assert (a.width, b.width) == (2, 5)
    with pytest.raises(TypeError, match="no field"):
        a.replace(height=1)


def test_slots_reject_typos() -> None:
    c = Inner.Config()
    with pytest.raises(AttributeError):
        c.widht = 3  # type: ignore[attr-defined]


def test_traverse_visits_nested_configs() -> None:
    cfg = Outer.Config(blocks=[Inner.Config(width=1), Inner.Config(width=2)])
    paths = [(p, type(c).__qualname__) for p, c in cfg.traverse()]
    assert paths == [("", "Outer.Config"), ("inner", "Inner.Config"), ("blocks[0]", "Inner.Config"),
                     ("blocks[1]", "Inner.Config")]


def test_to_dict_is_yaml_dumpable() -> None:
    cfg = Outer.Config(sharding=ShardingConfig(state_shardings={"weight": {MeshAxisName.TP: Shard(0)}}))
    d = cfg.to_dict()
    text = yaml.safe_dump(d)
    back: Any = yaml.safe_load(text)
    assert back["inner"] == {"width": 4}
    assert back["sharding"]["state_shardings"] == {"weight": {"tp": "Shard(dim=0)"}}


def test_config_must_be_kw_only_and_slotted() -> None:
    with pytest.raises(TypeError, match="no __slots__"):
        class NoSlots(Configurable):
            @dataclasses.dataclass(kw_only=True)
            class Config(Configurable.Config):
                a: int = 1

    with pytest.raises(TypeError, match=r"Config\.a is not keyword-only"):
        class Positional(Configurable):
            @dataclasses.dataclass(slots=True)
            class Config(Configurable.Config):
                a: int = 1


def test_mesh_axis_literals() -> None:
    assert [m.value for m in MeshAxisName] == ["dp", "dp_replicate", "dp_shard", "fsdp", "tp", "cp", "pp", "ep",
                                               "efsdp"]
