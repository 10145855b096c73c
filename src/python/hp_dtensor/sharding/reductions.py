"""Reductions over dims (sum, mean, amax/amin, any/all, max/min with indices).

A shard on a reduced dim becomes ``Partial`` of the matching op (sum -> sum, mean -> avg under
even sharding, amax and any -> max, amin and all -> min); shards on kept dims move with the dim.  A Partial input
flows through sum/mean (linear) and is reduced first for the others.  Ops returning indices
gather the reduced dim instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.layout.shard_geometry import is_even
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import dims_arg, dims_of, float_arg, keepdim_arg, prim_inputs, reduce_args
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, Rule, TensorInfo, sees_uneven

# any/all give booleans: the any of every rank's any is their max, the all their min.
_PARTIAL_OF = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min", "any": "max", "all": "min"}


def reduction_rule(
    call: OpCall, kind: str, dims: Sequence[int] | None, keepdim: bool, n_outputs: int = 1
) -> Decision:
    t: TensorInfo = call.args[0]
    ndim = max(t.ndim, 1)
    red = set(range(t.ndim)) if dims is None or len(dims) == 0 else {d % ndim for d in dims}
    req: list[Placement] = []
    out: list[Placement] = []
    even = is_even(t.shape, call.mesh_shape, t.placements)
    for p in t.placements:
        if isinstance(p, Shard) and p.dim in red:
            # A mean of unequal shards is not the mean of the shard means: gather those.
            if kind in _PARTIAL_OF and (even or kind != "mean"):
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


def _reduced(t: TensorInfo, dims: Sequence[int] | None) -> set[int]:
    ndim = max(t.ndim, 1)
    return set(range(t.ndim)) if dims is None or len(dims) == 0 else {d % ndim for d in dims}


def uneven_reduction_rule(call: OpCall, dims: Sequence[int] | None, keepdim: bool, n_outputs: int = 1) -> Decision | None:
    """A reduction of an unevenly sharded input over dims no mesh dim shards (an RMSNorm's mean
    over the hidden dim of a sequence-sharded activation): each rank reduces its own rows and the
    uneven layout is kept, instead of gathering the input.  None when a sharded dim is reduced
    or an input is Partial (then the even-layout rule decides)."""
    t: TensorInfo = call.args[0]
    red = _reduced(t, dims)
    if any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in red) for p in t.placements):
        return None
    out = tuple(
        Shard(p.dim - sum(d < p.dim for d in red)) if isinstance(p, Shard) and not keepdim else p
        for p in t.placements
    )
    shape = tuple(1 if d in red else n for d, n in enumerate(t.shape) if keepdim or d not in red)
    return Decision((t.placements,), tuple(out for _ in range(n_outputs)), out_shape=shape)


def gathered_reduction_rule(call: OpCall, dims: Sequence[int] | None, keepdim: bool, n_outputs: int = 1) -> Decision:
    """A reduction that is not a sum of per-rank parts (``var``, ``std``): reduced dims are
    gathered and Partial inputs reduced first; shards on kept dims move with the dim."""
    t: TensorInfo = call.args[0]
    red = _reduced(t, dims)
    req: list[Placement] = []
    out: list[Placement] = []
    for p in t.placements:
        if isinstance(p, Shard) and p.dim not in red:
            req.append(p)
            out.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in red)))
        else:
            req.append(Replicate())
            out.append(Replicate())
    return Decision((tuple(req),), tuple(tuple(out) for _ in range(n_outputs)))


def vector_norm_rule(call: OpCall, ord_: float, dims: Sequence[int] | None, keepdim: bool) -> Decision:
    """``linalg_vector_norm``: with a finite ``ord`` each rank sums ``|x|^ord`` over its part of
    a sharded reduced dim and the platform's ``vector_norm`` kernel all-reduces those sums before
    the root (one small all_reduce, no gather).  ``ord=±inf`` gathers the reduced dims."""
    if ord_ in (float("inf"), float("-inf")):
        return gathered_reduction_rule(call, dims, keepdim)
    t: TensorInfo = call.args[0]
    red = _reduced(t, dims)
    req: list[Placement] = []
    out: list[Placement] = []
    for p in t.placements:
        if isinstance(p, Shard) and p.dim in red:
            req.append(p)
            out.append(Replicate())  # the kernel all-reduces over this mesh dim
        elif isinstance(p, Shard):
            req.append(p)
            out.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in red)))
        else:
            req.append(Replicate())
            out.append(Replicate())
    kernel = "vector_norm" if any(isinstance(p, Shard) and p.dim in red for p in req) else None
    return Decision((tuple(req),), (tuple(out),), kernel=kernel)


# ---------------------------------------------------------------- ops as the backends call them
def reduction_family(kind: str) -> Rule:
    """The rule of a ``kind`` reduction in any of its call forms (``reduce_args``); a max/min
    over a sharded dim runs as the ``extremum_<kind>`` kernel (``extremum_across_ranks``)."""

    def rule(call: OpCall) -> Decision:
        x, dims, keep = reduce_args(call)
        dec = reduction_rule(OpCall(call.name, call.mesh_shape, (x,)), kind, dims, keep)
        if kind in ("amax", "amin"):
            return extremum_across_ranks(dec, kind)
        return dec

    def uneven(call: OpCall) -> Decision | None:
        x, dims, keep = reduce_args(call)
        return uneven_reduction_rule(OpCall(call.name, call.mesh_shape, (x,)), dims, keep)

    return sees_uneven(rule, uneven)


def extremum_across_ranks(dec: Decision, kind: str) -> Decision:
    """A max/min over a sharded dim runs as the ``extremum_<kind>`` kernel: the global value on
    every rank (Replicate where the rule said Partial), with MindSpore's gradient -- split evenly
    among the *global* ties across shards.  Left Partial, each rank's local backward would split
    the gradient among its own local maxima, whether or not they are the global one."""
    req, out = dec.inputs[0], dec.outputs[0]
    assert req is not None and out is not None
    across = [k for k, (r, o) in enumerate(zip(req, out)) if isinstance(r, Shard) and isinstance(o, Partial)]
    if not across:
        return dec
    rep = tuple(Replicate() if k in across else o for k, o in enumerate(out))
    return Decision(dec.inputs, (rep,), kernel=f"extremum_{kind}")


def lp_norm_rule(call: OpCall) -> Decision:
    """``ops.norm(x, p, dim)``: the LpNorm primitive (its axis, p and keep_dims are attributes of
    the primitive, the call's first argument) is not a sum of per-rank parts; a sharded reduced
    dim is gathered, kept dims stay sharded."""
    prim, x = call.args[0], prim_inputs(call)[0]
    attrs = getattr(prim, "attrs", {})
    dims = dims_of(attrs.get("axis"))
    return gathered_reduction_rule(OpCall(call.name, call.mesh_shape, (x,)), dims, bool(attrs.get("keep_dims", False)))


# ---------------------------------------------------------------- the ops these rules cover
def _over_dims(kind: str) -> Rule:
    """A ``kind`` reduction ``(x, dims, keepdim)``, kept shard by shard on an unevenly sharded
    input whose sharded dims it does not reduce."""
    return sees_uneven(
        lambda c: reduction_rule(c, kind, dims_arg(c, 1), keepdim_arg(c, 2)),
        lambda c: uneven_reduction_rule(c, dims_arg(c, 1), keepdim_arg(c, 2)),
    )


ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("sum", lambda c: reduction_rule(c, "sum", None, False))
ATEN_OPS.add("sum.dim_IntList", _over_dims("sum"))
ATEN_OPS.add("mean", lambda c: reduction_rule(c, "mean", None, False))
ATEN_OPS.add("mean.dim", _over_dims("mean"))
ATEN_OPS.add("amax", _over_dims("amax"))
ATEN_OPS.add("amin", _over_dims("amin"))
ATEN_OPS.add("max", lambda c: reduction_rule(c, "amax", None, False))
ATEN_OPS.add("min", lambda c: reduction_rule(c, "amin", None, False))
ATEN_OPS.add("max.dim", lambda c: reduction_rule(c, "max_with_indices", dims_arg(c, 1), keepdim_arg(c, 2), 2))
ATEN_OPS.add("min.dim", lambda c: reduction_rule(c, "min_with_indices", dims_arg(c, 1), keepdim_arg(c, 2), 2))
ATEN_OPS.add("any", lambda c: reduction_rule(c, "any", None, False))
ATEN_OPS.add("any.dim any.dims", lambda c: reduction_rule(c, "any", dims_arg(c, 1), keepdim_arg(c, 2)))
ATEN_OPS.add("all", lambda c: reduction_rule(c, "all", None, False))
ATEN_OPS.add("all.dim all.dims", lambda c: reduction_rule(c, "all", dims_arg(c, 1), keepdim_arg(c, 2)))
ATEN_OPS.add("argmax", lambda c: reduction_rule(c, "argmax", dims_arg(c, 1), keepdim_arg(c, 2)))
# var/std take keepdim by keyword only.
ATEN_OPS.add(
    "var.correction std.correction",
    lambda c: gathered_reduction_rule(c, dims_arg(c, 1), bool(c.kwargs.get("keepdim", False))),
)
ATEN_OPS.add("logsumexp", lambda c: gathered_reduction_rule(c, dims_arg(c, 1), keepdim_arg(c, 2)))
ATEN_OPS.add(
    "var_mean.correction std_mean.correction",
    lambda c: gathered_reduction_rule(c, dims_arg(c, 1), bool(c.kwargs.get("keepdim", False)), 2),
)
ATEN_OPS.add(
    "linalg_vector_norm",
    lambda c: vector_norm_rule(c, float_arg(c, 1, "ord", 2), dims_arg(c, 2), keepdim_arg(c, 3)),
)

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("SumExt ReduceSum", reduction_family("sum"))
# (``Tensor.mean(axis, keep_dims=...)`` with MindSpore's own keyword reaches DeprecatedMean,
# whose arguments are the functional form's: input, axis, keep_dims)
MINDSPORE_OPS.add("MeanExt ReduceMean DeprecatedMean", reduction_family("mean"))
MINDSPORE_OPS.add("ReduceMax Max", reduction_family("amax"))
MINDSPORE_OPS.add("ReduceMin Min", reduction_family("amin"))
MINDSPORE_OPS.add("ReduceAny Any AnyExt", reduction_family("any"))
MINDSPORE_OPS.add("ReduceAll All AllExt", reduction_family("all"))
MINDSPORE_OPS.add("LpNorm", lp_norm_rule)
