"""Pointwise ops on unevenly sharded inputs, computed shard by shard without gathering.

Other rules see uneven inputs in their nearest even layout (the dispatch replicates uneven
shards first).  A pointwise op needs no such detour when every uneven input has the same
placements, the output's rank and the output's size on each sharded dim (an activation and its
per-row statistics, say): each rank holds matching rows of every input (even inputs of the
output's size there are laid out alike, broadcast ones replicated along the sharded dims), so
the local op gives this rank's rows of the output, uneven like the inputs.
"""

from __future__ import annotations

from hp_dtensor.layout.shard_geometry import is_even
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo
from hp_dtensor.sharding.pointwise import _follow, _out_shape


def uneven_pointwise_rule(call: OpCall, *, n_outputs: int = 1, inplace: bool = False) -> Decision | None:
    """The decision keeping the uneven layout, or None when the inputs do not allow it."""
    infos = call.tensors()
    uneven = [t for t in infos if not is_even(t.shape, call.mesh_shape, t.placements)]
    if not uneven:
        return None
    lead = uneven[0]
    if any(isinstance(p, Partial) for p in lead.placements):
        return None
    out_shape = _out_shape(infos)

    def holds_its_rows(t: TensorInfo) -> bool:
        # the lead's placements, the output's rank and the output's size on every sharded dim:
        # each rank's piece is its rows of the output, whatever the other dims broadcast
        return t.placements == lead.placements and t.ndim == len(out_shape) and all(
            t.shape[p.dim] == out_shape[p.dim] for p in t.placements if isinstance(p, Shard)
        )

    if not all(holds_its_rows(t) for t in uneven):
        return None
    req: list[tuple[Placement, ...]] = []
    for t in infos:
        req.append(
            tuple(
                _follow(t, p.dim, len(out_shape), out_shape) if isinstance(p, Shard) else Replicate()
                for p in lead.placements
            )
        )
    if inplace and req[0] != infos[0].placements:
        return None
    return Decision(tuple(req), (lead.placements,) * n_outputs, out_shape=lead.shape)
