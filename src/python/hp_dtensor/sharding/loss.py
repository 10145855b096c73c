"""Negative log-likelihood on log-probabilities (the tail of cross entropy).

With ``reduction="none"`` a batch shard flows to the per-sample losses.  Otherwise the inputs are
gathered over the class dim and the batch: the mean's denominator needs every target.  Loss
parallel over a vocab-sharded class dim is the job of ``hp_tp.loss_parallel``.
"""

from __future__ import annotations

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import int_arg
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo


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


def mse_loss_rule(call: OpCall, reduction: int) -> Decision:
    """``mse_loss(self, target, reduction)``: target follows self's shards.  ``"none"`` keeps them;
    ``"mean"``/``"sum"`` sum locally into a ``Partial("sum")``, the mean divided by the global
    element count (the platform's ``mse_loss`` kernel), so uneven shards weigh right."""
    x, y = call.tensors()[:2]
    if x.shape != y.shape:  # broadcasting targets: compare whole tensors
        rep = tuple(Replicate() for _ in x.placements)
        return Decision((rep, rep), (rep,))
    req = tuple(p if isinstance(p, Shard) else Replicate() for p in x.placements)
    if reduction == 0:
        return Decision((req, req), (req,))
    out = tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in req)
    return Decision((req, req), (out,), args=(x, y, reduction, x.numel), kwargs={}, kernel="mse_loss")


def mse_loss_backward_rule(call: OpCall, reduction: int) -> Decision:
    """``mse_loss_backward(grad_output, self, target, reduction)``."""
    g, x, y = call.tensors()[:3]
    if x.shape != y.shape:
        rep = tuple(Replicate() for _ in x.placements)
        return Decision((rep, rep, rep), (rep,))
    req = tuple(p if isinstance(p, Shard) else Replicate() for p in x.placements)
    if reduction == 0:
        return Decision((req, req, req), (req,))
    rep = tuple(Replicate() for _ in g.placements)
    return Decision((rep, req, req), (req,), args=(g, x, y, reduction, x.numel), kwargs={}, kernel="mse_loss_backward")


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("nll_loss_forward nll_loss2d_forward", lambda c: nll_loss_rule(c, int_arg(c, 3, "reduction", 1)))
ATEN_OPS.add("nll_loss_backward", lambda c: nll_loss_backward_rule(c, int_arg(c, 4, "reduction", 1)))
ATEN_OPS.add("mse_loss", lambda c: mse_loss_rule(c, int_arg(c, 2, "reduction", 1)))
ATEN_OPS.add("mse_loss_backward", lambda c: mse_loss_backward_rule(c, int_arg(c, 3, "reduction", 1)))
