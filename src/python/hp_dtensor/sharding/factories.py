"""Factories shaped like a DTensor argument (``zeros_like``, ``new_zeros``): no data is read,
only the layout and the size asked for."""

from __future__ import annotations

from hp_dtensor.layout.shard_geometry import local_shape
from hp_dtensor.placement_types import Replicate, partials_replicated
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo, keeps_uneven
from hp_dtensor.sharding.strides import contiguous_strides


def like_factory_rule(call: OpCall) -> Decision:
    """``*_like(x)``: laid out like ``x`` (a fresh value is not a sum of terms: Partial reads as
    Replicate)."""
    t: TensorInfo = call.args[0]
    return Decision((t.placements,), (partials_replicated(t.placements),))


def new_factory_rule(call: OpCall, size_pos: int = 1, strides_pos: int | None = None) -> Decision:
    """``x.new_*(size, ...)``: laid out like ``x`` when the size is ``x``'s, else replicated; the
    local call gets this rank's shard size (and contiguous strides for it at ``strides_pos``)."""
    t: TensorInfo = call.args[0]
    size = tuple(call.args[size_pos])
    out = partials_replicated(t.placements) if size == t.shape else tuple(Replicate() for _ in t.placements)
    loc = list(local_shape(size, call.mesh_shape, out, call.coordinate))
    args = list(call.args)
    args[size_pos] = loc
    if strides_pos is not None:
        args[strides_pos] = list(contiguous_strides(loc))
    return Decision((t.placements,), (out,), args=tuple(args))


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("ones_like zeros_like empty_like full_like", keeps_uneven(like_factory_rule))
ATEN_OPS.add("new_empty new_zeros new_ones new_full", new_factory_rule)
ATEN_OPS.add("new_empty_strided", lambda c: new_factory_rule(c, strides_pos=2))
