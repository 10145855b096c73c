"""The op tables: every aten name a rule module lists is an op of the installed torch, and a
name listed twice is refused (the kernels rules name: ``mindspore/test_ms_op_tables.py``).

The tables are strings, so a misspelt name would not fail at import: that op would silently fall
back to replication (correct numbers, a warning, all-gathers where none were meant).
"""

from __future__ import annotations

import pytest
import torch

import hp_dtensor.platform.torch  # noqa: F401  (registers the torch kernels)
from hp_dtensor.placement_types import Replicate
from hp_dtensor.platform.torch.dispatch import _find_rule
from hp_dtensor.sharding.foreach import foreach_rule
from hp_dtensor.sharding.op_call import Decision, OpRules
from hp_dtensor.sharding.op_tables import ATEN_RULES, FOREACH_RULES, MINDSPORE_RULES


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)  # type: ignore[no-any-return]


def test_every_aten_name_is_an_op_of_this_torch() -> None:
    missing = []
    for name in ATEN_RULES:
        try:
            op = _overload(name)
        except (AttributeError, RuntimeError, ValueError):
            missing.append(name)
            continue
        assert str(op) == name
        assert _find_rule(op) is ATEN_RULES[name]
    print(f"{len(ATEN_RULES)} aten ops, {len(MINDSPORE_RULES)} MindSpore ops, {len(FOREACH_RULES)} foreach bases")
    assert not missing, f"op names that torch {torch.__version__} does not have: {missing}"
    assert len(ATEN_RULES) >= 245 and len(MINDSPORE_RULES) >= 117


def test_every_random_op_name_is_an_op_of_this_torch() -> None:
    """A misspelt name would let that op run shard by shard, each rank drawing its own values."""
    from hp_dtensor.platform.torch.dispatch import _RANDOM, _facts
    from hp_dtensor.sharding.random_ops import ATEN_RANDOM_OPS

    for name in ATEN_RANDOM_OPS:
        op = _overload(name)
        assert str(op) == name and _facts(op)[0] == _RANDOM, name
    assert len(ATEN_RANDOM_OPS) == 18


def test_foreach_ops_take_their_base_ops_rule() -> None:
    aten = torch.ops.aten
    assert _find_rule(aten._foreach_add_.List) is FOREACH_RULES["add"]
    assert _find_rule(aten._foreach_norm.Scalar) is FOREACH_RULES["norm"]
    assert _find_rule(aten._foreach_sqrt_.default) is FOREACH_RULES["*"]
    # the per-tensor reductions and products are not elementwise: each tensor gathered
    for op in (aten._foreach_max.default, aten._foreach_powsum.Scalar, aten._foreach_mm.default):
        assert _find_rule(op) is FOREACH_RULES["norm"], op
    # every other foreach op torch has is elementwise, and takes a pointwise rule
    names = {s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")}
    bases = {n[len("aten::_foreach_"):].rstrip("_") for n in names} - {"max", "powsum", "mm", "norm"}
    assert all(getattr(foreach_rule(b), "uneven_pointwise", None) for b in bases), sorted(bases)


def test_a_name_listed_twice_is_refused() -> None:
    def rule(call: object) -> Decision:
        return Decision(((Replicate(),),), ((Replicate(),),))

    ops = OpRules("aten", "default")
    ops.add("mm bmm.default", rule)
    assert set(ops) == {"aten.mm.default", "aten.bmm.default"}
    with pytest.raises(ValueError, match=r"op aten\.mm\.default is given two sharding rules"):
        ops.add("addmm mm", rule)
    with pytest.raises(ValueError, match="op MatMul is given two sharding rules"):
        OpRules().merge(_table("MatMul"), _table("Dense MatMul"))


def _table(names: str) -> OpRules:
    t = OpRules()
    t.add(names, lambda call: Decision((), ()))
    return t
