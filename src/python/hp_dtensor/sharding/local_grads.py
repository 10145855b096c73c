"""Gradient bookkeeping for a backend whose autograd runs on local tensors (MindSpore's).

Gradient convention (torch.distributed.tensor's, kept by both backends): the local gradient a rank
holds for a DTensor is the gradient of the loss with respect to the *global* value, laid out as
the value is, with every ``Partial`` mesh dim read as ``Replicate``.  So the gradient of
``Shard(d)`` is ``Shard(d)``, of ``Replicate`` the full gradient on every rank, and of a
``Partial`` term -- ``"sum"`` and ``"avg"`` alike -- the full gradient G on every rank.  For
``Partial("avg")`` this is *not* the derivative with respect to the rank's own term (that would
be G/n): torch keeps the replicated gradient in backward instead of re-partialing it, and so do
we, so the same program gives the same numbers on both backends.

On torch the DTensor's autograd sees DTensors and Partial gradients.  A backend whose autograd
runs on the local tensors instead has to collect, around each op, what the op's local backward
leaves as one rank's term: a replicated input whose op gives ranks different outputs gets its
gradient summed over those mesh dims (Megatron's "f"), and an input whose op makes a
``Partial("avg")`` term gets the 1/n factor.  ``grad_facts`` derives both from a decision, once
per cached decision; ``GradLayout`` lets a replicated value made by ``redistribute`` collect its
gradient as per-rank terms, so that its own backward sums them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hp_dtensor.placement_types import Partial, Replicate
from hp_dtensor.sharding.op_call import Decision, OpCall


class GradLayout:
    """How the gradient of a replicated value produced by ``redistribute`` comes back: whole on
    every rank (``partial == ()``) or as per-rank terms to be summed over the mesh dims in
    ``partial``.  The value's first consumer decides (``None`` until then); later consumers adapt
    their own contribution to it, and the redistribution's backward reads it, so a value gathered
    once and used by several column-parallel layers is reduced once (reduce_scatter back to its
    shards) instead of once per layer.  Redistribute inside the function you differentiate: a
    redistributed value passed to ``mindspore.grad`` as an input may get its gradient as those
    terms."""

    __slots__ = ("partial",)

    def __init__(self, partial: tuple[int, ...] | None = None) -> None:
        self.partial = partial

    def adapt(self, dims: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A consumer whose local backward leaves terms on the mesh dims ``dims``: ``(missing,
        extra)``, the dims its contribution must be summed over (the layout wants them whole) and
        those on which it must be kept on coordinate 0 only (the layout sums them later)."""
        if self.partial is None:
            self.partial = dims
        missing = tuple(k for k in dims if k not in self.partial)
        extra = tuple(k for k in self.partial if k not in dims)
        return missing, extra

    def whole_use(self) -> tuple[int, ...]:
        """A consumer whose backward hands back a whole gradient: the mesh dims on which its
        contribution is kept on coordinate 0 only (empty when the layout is whole)."""
        if self.partial is None:
            self.partial = ()
        return self.partial


@dataclass(frozen=True, slots=True)
class GradFacts:
    """What the gradient bookkeeping derives from a decision, per DTensor input: the mesh dims on
    which the op's local backward yields only this rank's term of the input's gradient, whether
    the op passes the input's gradient through unchanged in form (``replicated_where_input_is``),
    and the factor its local gradient takes (``avg_grad_scale``)."""

    grad_dims: tuple[tuple[int, ...], ...]
    transparent: tuple[bool, ...]
    grad_scale: tuple[float, ...]


def grad_facts(call: OpCall, decision: Decision) -> GradFacts:
    reqs = [target if target is not None else t.placements for t, target in zip(call.tensors(), decision.inputs)]
    grad_dims = tuple(grad_sum_dims(req, decision.outputs) for req in reqs)
    single = len(reqs) == 1
    transparent = tuple(
        single and not dims and replicated_where_input_is(req, decision.outputs) for req, dims in zip(reqs, grad_dims)
    )
    scale = tuple(avg_grad_scale(req, decision.outputs, call.mesh_shape) for req in reqs)
    return GradFacts(grad_dims, transparent, scale)


def avg_grad_scale(req: tuple[Any, ...], outputs: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> float:
    """1/n for each mesh dim of size n where an output is ``Partial("avg")`` but the input is not
    Partial (a mean over a sharded dim, a Partial("avg") factor times a replicated one).

    The global value is the mean of the ranks' terms, so the loss's derivative with respect to one
    term is G/n; but the gradient a Partial output receives is G itself (the convention above),
    which the local backward would hand on unscaled.  An input that is Partial("avg") there needs
    no factor: its own gradient is G by the same convention."""
    scale = 1.0
    for k, p in enumerate(req):
        if isinstance(p, Partial):
            continue
        if any(o is not None and isinstance(o[k], Partial) and o[k].reduce_op == "avg" for o in outputs):
            scale /= mesh_shape[k]
    return scale


def grad_sum_dims(req: tuple[Any, ...], outputs: tuple[Any, ...]) -> tuple[int, ...]:
    """Mesh dims where ``req`` is Replicate but some output differs between ranks."""
    return tuple(
        k for k, p in enumerate(req)
        if isinstance(p, Replicate) and any(o is not None and not isinstance(o[k], Replicate) for o in outputs)
    )


def replicated_where_input_is(req: tuple[Any, ...], outputs: tuple[Any, ...]) -> bool:
    """Every output is replicated exactly where the (only) input is: every rank computes the same
    thing there, so the op passes a gradient through in whatever form it comes (whole or as
    terms).  An output replicated where the input is sharded (a kernel that reduces across ranks
    inside, like a max over a sharded dim) needs its gradient whole: its backward is not linear
    in per-rank terms of it."""
    return all(
        o is None or all(isinstance(o[k], Replicate) == isinstance(p, Replicate) for k, p in enumerate(req))
        for o in outputs
    )
