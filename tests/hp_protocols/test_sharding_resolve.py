# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""resolve_placements: mesh order, Replicate for undeclared axes, errors for unknown axes."""

import pytest

from hp_dtensor import Partial, Replicate, Shard
from hp_protocols import MeshAxisName, resolve_placements


def test_in_mesh_order_with_replicate_default() -> None:
    named = {MeshAxisName.TP: Shard(0), MeshAxisName.FSDP: Partial()}
    assert resolve_placements(named, ("pp", "fsdp", "tp")) == [Replicate(), Partial(), Shard(0)]
    assert resolve_placements({}, ("tp",)) == [Replicate()]
    assert resolve_placements({"tp": Shard(1)}, ("tp",)) == [Shard(1)]


def test_unknown_axis_raises() -> None:
    with pytest.raises(ValueError, match=r"axes not in mesh: \['ep'\]"):
        resolve_placements({MeshAxisName.EP: Shard(0)}, ("tp",))
    with pytest.raises(ValueError, match="mesh_dim_names"):
        resolve_placements({}, None)
