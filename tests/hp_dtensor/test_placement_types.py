# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Placements are immutable values with readable reprs and clear errors."""

import pytest

from hp_dtensor.placement_types import Partial, Replicate, Shard, normalize_placements


def test_equal_by_value_and_hashable() -> None:
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0)
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum") != Partial("max")
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("avg")}) == 4


def test_immutable() -> None:
    s = Shard(0)
    with pytest.raises(AttributeError):
        s.dim = 1  # type: ignore[misc]


def test_repr() -> None:
    assert repr(Shard(-1)) == "Shard(dim=-1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial("avg")) == "Partial(avg)"


def test_negative_dim_resolves_against_tensor() -> None:
    assert Shard(-1).normalize(3) == Shard(2)
    assert normalize_placements([Shard(-1), Replicate()], 2, tensor_ndim=4) == (Shard(3), Replicate())
    with pytest.raises(ValueError, match="out of range"):
        Shard(3).normalize(3)


def test_bad_values_raise_naming_them() -> None:
    with pytest.raises(ValueError, match="'mean'"):
        Partial("mean")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int dim"):
        Shard("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 placements .* 1-D mesh"):
        normalize_placements([Shard(0), Shard(1)], 1)
    with pytest.raises(TypeError, match="Shard/Replicate/Partial"):
        normalize_placements(["shard"], 1)


def test_single_placement_accepted_for_1d_mesh() -> None:
    assert normalize_placements(Shard(0), 1) == (Shard(0),)
