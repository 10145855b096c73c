"""Reductions over dims (sum, mean, amax/amin, max/min with indices).

A shard on a reduced dim becomes ``Partial`` of the matching op (sum -> sum, mean -> avg under
even sharding, amax -> max, amin -> min); shards on kept dims move with the dim.  A Partial input
flows through sum/mean (linear) and is reduced first for the others.  Ops returning indices
gather the reduced dim instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo

_PARTIAL_OF = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min"}


def reduction_rule(
    call: OpCall, kind: str, dims: Sequence[int] | None, keepdim: bool, n_outputs: int = 1
) -> Decision:
    t: TensorInfo = call.args[0]
    ndim = max(t.ndim, 1)
    red = set(range(t.ndim)) if dims is None or len(dims) == 0 else {d % ndim for d in dims}
    req: list[Placement] = []
    out: list[Placement] = []
    for p in t.placements:
        if isinstance(p, Shard) and p.dim in red:
            if kind in _PARTIAL_OF:
                req.append(p)
                out.append(Partial(_PARTIAL_OF[kind]))  # type: ignore[arg-type]
            else:
                req.append(Replicate())
                out.append(Replicate())
        elif isinstance(p, Shard):
            req.append(p)
            out.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in red)))
        elif isinstance(p, Partial):
            if kind in ("sum", "mean") and p.reduce_op in ("sum", "avg"):
                req.append(p)
                out.append(p)
            else:
                req.append(Replicate())
                out.append(Replicate())
        else:
            req.append(p)
            out.append(p)
    return Decision((tuple(req),), tuple(tuple(out) for _ in range(n_outputs)))
