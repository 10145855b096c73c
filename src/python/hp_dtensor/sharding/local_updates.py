"""In-place updates of a DTensor by values already in its layout (optimizer steps, ``copy_``).

An optimizer updates a DTensor parameter with its local gradient and state: every argument is in
the layout of the tensor it updates, so the op runs shard by shard and keeps that layout (uneven
or not).  On a ``Partial`` tensor only the updates that commute with the reduction when applied
to each rank's term are allowed (scaling, zeroing, copying a value of the same layout); any other
would act once per rank.
"""

from __future__ import annotations

from collections.abc import Collection

from hp_dtensor.placement_types import Partial
from hp_dtensor.sharding.op_call import Decision, OpCall, Rule


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
