"""In-place updates of a DTensor by values already in its layout (optimizer steps, ``copy_``).

An optimizer updates a DTensor parameter with its local gradient and state: every argument is in
the layout of the tensor it updates, so the op runs shard by shard and keeps that layout (uneven
or not).  On a ``Partial`` tensor only the updates that commute with the reduction when applied
to each rank's term are allowed (scaling, zeroing, copying a value of the same layout); any other
would act once per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from hp_dtensor.placement_types import Partial
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, Rule


def local_update_rule(partial_safe: Collection[str]) -> Rule:
    """The rule of the in-place update ops; ``partial_safe`` names those that commute with a
    Partial reduction."""

    def rule(call: OpCall) -> Decision:
        tensors = call.tensors()
        first = tensors[0]
        if any(isinstance(p, Partial) for p in first.placements) and (
            call.name not in partial_safe or any(t.placements != first.placements for t in tensors[1:])
        ):
            raise ValueError(
                f"in-place {call.name} on a DTensor with placements {first.placements} would apply to every "
                f"rank's partial term; call .redistribute(placements=[Replicate()]) (or .full_tensor()) first"
            )
        return Decision(tuple(None for _ in tensors), (first.placements,), out_shape=first.shape)

    return rule


def is_one_element(shape: tuple[int, ...]) -> bool:
    """Step counters and learning rates arrive as one-element tensors: scalars, not shards."""
    return all(s == 1 for s in shape)


def join_local_updates(
    name: str, flat: list[Any], dtensor_type: Any, tensor_type: Any, shape_of: Callable[[Any], tuple[int, ...]]
) -> list[Any]:
    """The arguments of update op ``name`` with each plain tensor of the first DTensor's local
    shape -- that DTensor's local gradient or state, what ``value_and_grad`` returns for a DTensor
    parameter -- wrapped with its spec (``dtensor_type(local, spec)``); one-element tensors stay
    scalars.  A plain tensor of another shape is refused, naming both shapes."""
    first = next((x for x in flat if isinstance(x, dtensor_type)), None)
    if first is None:
        return flat
    spec = first._spec
    want = spec.local_shape()
    out = []
    for x in flat:
        got = shape_of(x) if isinstance(x, tensor_type) else ()
        if isinstance(x, tensor_type) and not isinstance(x, dtensor_type) and got and not is_one_element(got):
            if got != want:
                raise RuntimeError(
                    f"{name}: a plain tensor of shape {got} updates a DTensor whose local shard is {want}; "
                    f"pass the local gradient/state (shape {want}) or a DTensor"
                )
            x = dtensor_type(x, spec)
        out.append(x)
    return out


# ---------------------------------------------------------------- the ops these rules cover
# In-place updates and fused optimizer kernels (mint.optim) on MindSpore: a plain tensor of the
# DTensor's local shape among their arguments is that DTensor's local gradient or state -- what
# value_and_grad returns for a DTensor parameter -- so it joins with the first DTensor's spec and
# the op runs shard by shard.  Anywhere else a plain tensor next to a DTensor is an error.
_LOCAL_UPDATES = """
    AdamW Adam ApplyAdamW SGD ApplyMomentum Assign AssignAdd AssignSub InplaceAddExt InplaceAddsExt
    InplaceSubExt InplaceSubScalar InplaceMul InplaceMuls InplaceDiv InplaceDivs InplaceCopy InplaceAddcmul
    InplaceAddcdiv InplaceLerp InplaceSqrt InplaceZero InplaceFillScalar
"""
LOCAL_UPDATE_OPS = frozenset(_LOCAL_UPDATES.split())
# Those that commute with a Partial reduction when applied to each rank's term: scaling by a
# number, zeroing, copying a value of the same layout.  Any other (adding a number, filling,
# sqrt, ...) would act once per rank.
_PARTIAL_SAFE_UPDATES = frozenset({"InplaceMuls", "InplaceDivs", "InplaceZero", "InplaceCopy", "Assign"})

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add(_LOCAL_UPDATES, local_update_rule(_PARTIAL_SAFE_UPDATES))
