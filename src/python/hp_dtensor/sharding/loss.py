"""Negative log-likelihood on log-probabilities (the tail of cross entropy).

With ``reduction="none"`` a batch shard flows to the per-sample losses.  Otherwise the inputs are
gathered over the class dim and the batch: the mean's denominator needs every target.  Loss
parallel over a vocab-sharded class dim is the job of ``hp_tp.loss_parallel``.
"""

from __future__ import annotations

from hp_dtensor.placement_types import Placement, Replicate, Shard
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo


def nll_loss_rule(call: OpCall, reduction: int, n_outputs: int = 2) -> Decision:
    infos = call.tensors()
    x: TensorInfo = infos[0]
    rep = tuple(Replicate() for _ in x.placements)
    if reduction == 0 and x.ndim >= 2:
        req: tuple[Placement, ...] = tuple(
            p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in x.placements
        )
        ins = [req] + [req if t.ndim == x.ndim - 1 else rep for t in infos[1:]]
        return Decision(tuple(ins), (req, rep)[:n_outputs])
    return Decision(tuple(rep for _ in infos), tuple(rep for _ in range(n_outputs)))


def nll_loss_backward_rule(call: OpCall, reduction: int) -> Decision:
    """nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)."""
    infos = call.tensors()
    x: TensorInfo = infos[1]
    rep = tuple(Replicate() for _ in x.placements)
    if reduction == 0 and x.ndim >= 2:
        req: tuple[Placement, ...] = tuple(
            p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in x.placements
        )
        ins = [req, req, req] + [rep for _ in infos[3:]]
        return Decision(tuple(ins), (req,))
    return Decision(tuple(rep for _ in infos), (rep,))
