"""Ops whose result is a Python value or metadata (a comparison, an element, a type), not a tensor.

A Python value gives the global answer on every rank: an ``if`` on it must send every rank down
the same path.  So shards laid out alike are compared and the ranks agree with an
``all_reduce(min)`` (the platform's ``all_ranks_agree`` kernel), and an element is read from the
reduced, replicated tensor.
"""

from __future__ import annotations

from hp_dtensor.placement_types import Partial, Replicate
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo


def same_layout_rule(call: OpCall) -> Decision:
    """A question about shapes alone (``is_same_size``): every input stays as the first is."""
    infos = call.tensors()
    return Decision(tuple(infos[0].placements for _ in infos), ())


def global_compare_rule(call: OpCall) -> Decision:
    """``equal(a, b)`` / ``allclose(a, b)``: shards laid out alike (Partial reduced) compared by the
    ``all_ranks_agree`` kernel; ``equal`` of different shapes is ``constant_false``, ``allclose``
    (which broadcasts) compares whole tensors."""
    a, b = call.tensors()[:2]
    rep = tuple(Replicate() for _ in a.placements)
    if a.shape != b.shape:
        if call.name.startswith("aten.equal"):
            return Decision((None, None), (), kernel="constant_false")
        return Decision((rep, rep), ())
    pl = tuple(Replicate() if isinstance(p, Partial) else p for p in a.placements)
    return Decision((pl, pl), (), kernel="all_ranks_agree")


def python_value_rule(call: OpCall) -> Decision:
    """``item()``/``bool()``: the one element, reduced and replicated, read on every rank."""
    t: TensorInfo = call.args[0]
    return Decision((tuple(Replicate() for _ in t.placements),), ())


def metadata_rule(call: OpCall) -> Decision:
    """The type of a tensor (argument checks in MindSpore's nn cells): no data moves, nothing to wrap."""
    return Decision(tuple(None for _ in call.tensors()), ())


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("is_same_size", same_layout_rule)
ATEN_OPS.add("equal allclose", global_compare_rule)
ATEN_OPS.add("_local_scalar_dense is_nonzero", python_value_rule)

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("typeof", metadata_rule)
