"""Which sharding rule each MindSpore op uses (importing this module registers them).

The rules live in ``hp_dtensor.sharding`` and are shared with torch; this table is the
MindSpore half: op names as ``__fallback__`` reports them, where their arguments sit, and the
local kernels some rules need.  Primitive calls arrive as ``(prim, name, [inputs...])``.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore import Tensor, mint, ops
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.layout.shard_geometry import global_shape
from hp_dtensor.placement_types import Partial, Replicate, Shard
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore import rng
from hp_dtensor.platform.mindspore.dispatch import install_interceptors, kernel, register
from hp_dtensor.redistribute.executor import reduce_over
from hp_dtensor.sharding.casts import cast_rule
from hp_dtensor.sharding.embedding import embedding_rule, vocab_start
from hp_dtensor.sharding.matrix import batch_labels, einsum_rule, matmul_equation
from hp_dtensor.sharding.norms import layer_norm_rule, softmax_rule
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo
from hp_dtensor.sharding.pointwise import pointwise_rule
from hp_dtensor.sharding.reductions import gathered_reduction_rule, reduction_rule
from hp_dtensor.sharding.views import (
    cat_rule,
    permute_rule,
    stack_rule,
    transpose_rule,
    unsqueeze_rule,
    view_rule,
)


def _prim_inputs(call: OpCall) -> tuple[Any, ...]:
    """The inputs of a primitive call ``(prim, name, [inputs])``, or the args themselves."""
    if len(call.args) == 3 and isinstance(call.args[1], str) and isinstance(call.args[2], (list, tuple)):
        return tuple(call.args[2])
    return call.args


def _with_inputs(call: OpCall, inputs: tuple[Any, ...]) -> OpCall:
    return OpCall(call.name, call.mesh_shape, inputs, call.kwargs)


def _replicated(call: OpCall) -> Decision:
    """Compute on whole tensors: the shapes this op takes have no sharding rule here."""
    rep = tuple(Replicate() for _ in call.mesh_shape)
    return Decision(tuple(rep for _ in call.tensors()), (rep,))


# ---------------------------------------------------------------- pointwise
def _pw(linearity: str | None) -> Any:
    def rule(call: OpCall) -> Decision:
        return pointwise_rule(_with_inputs(call, _prim_inputs(call)), linearity=linearity)

    return _keeps_uneven(rule)


def _keeps_uneven(rule: Any, n_outputs: int = 1, kernel_name: str | None = None) -> Any:
    """Mark a pointwise rule: on unevenly sharded inputs dispatch may run it shard by shard
    (``uneven_pointwise_rule``), with ``kernel_name`` as its local kernel."""
    rule.uneven_pointwise = n_outputs
    rule.uneven_kernel = kernel_name
    return rule


def _not_a_dtensor(x: Any) -> bool:
    return not isinstance(x, TensorInfo)


@register("Add", "AddExt", "Sub", "SubExt")
def _add_sub(call: OpCall) -> Decision:
    """x + y stays Partial only when both operands are DTensors: a Python number or a plain scalar
    tensor would be added once per rank, so a Partial operand is reduced first."""
    inputs = _prim_inputs(call)
    linear = not any(_not_a_dtensor(x) for x in inputs[:2])
    return pointwise_rule(_with_inputs(call, inputs), linearity="add" if linear else None)


_keeps_uneven(_add_sub)


@register("Div", "RealDiv")
def _div(call: OpCall) -> Decision:
    """x / y is linear in x only: ``ops.div(1, x)`` (a number over a DTensor) is not."""
    inputs = _prim_inputs(call)
    linear = bool(inputs) and not _not_a_dtensor(inputs[0])
    return pointwise_rule(_with_inputs(call, inputs), linearity="div" if linear else None)


_keeps_uneven(_div)


@register("ToDtype", "Cast")
def _cast(call: OpCall) -> Decision:
    """``astype``/``ops.cast``: a Partial input stays Partial only through a cast that loses
    nothing (``cast_rule``); before a narrowing one (to float16, an integer, bool) it is reduced
    in its own dtype, as one process would round the reduced value once."""
    inputs = _prim_inputs(call)
    target = inputs[1] if len(inputs) > 1 else call.kwargs.get("dtype")
    return cast_rule(_with_inputs(call, inputs), target)


_keeps_uneven(_cast)


register("AddN")(_pw("add"))
register("Mul", "Muls", "Neg", "Contiguous", "Clone", "Identity", "Divs")(_pw("mul"))
register(
    "AddScalar", "SubScalar", "ReLU", "SiLU", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Rsqrt", "Square",
    "Pow", "PowTensorScalar", "GeLU", "Erf", "Abs", "Maximum", "Minimum", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "Select", "Softplus", "LogicalNot", "Cos", "Sin", "Reciprocal",
    "ClampScalar", "OnesLike", "ZerosLike", "LeakyReLUExt", "FastGeLU",
)(_pw(None))


@register("BiasAdd")
def _bias_add(call: OpCall) -> Decision:
    x, b = _prim_inputs(call)[:2]
    if x.ndim != 2:
        return _replicated(call)  # NCHW: the bias broadcasts on dim 1, not the trailing dim
    return pointwise_rule(_with_inputs(call, (x, b)), linearity="add")


# ---------------------------------------------------------------- random
@register("Dropout")
def _dropout(call: OpCall) -> Decision:
    """Dropout(x) -> (y, mask): pointwise on x (a Partial is reduced first: dropping terms is not
    dropping the sum), with the mask drawn from the job-wide stream (see ``rng.py``)."""
    x = _prim_inputs(call)[0]
    dec = pointwise_rule(_with_inputs(call, (x,)), linearity=None, n_outputs=2)
    return Decision(dec.inputs, dec.outputs, kernel="dropout")


_keeps_uneven(_dropout, 2, "dropout")


@kernel("dropout")
def _dropout_kernel(mesh: Any, decision: Decision, *args: Any) -> tuple[Tensor, Tensor]:
    prim = args[0]
    x = C._plain(_prim_inputs(OpCall("Dropout", mesh.shape, args))[0])
    keep = float(prim.attrs["keep_prob"])
    out_pl = decision.outputs[0]
    assert out_pl is not None
    gshape = decision.out_shape or global_shape(tuple(Tensor.shape.fget(x)), mesh.shape, out_pl)
    u = Tensor(rng.uniform_local(mesh, gshape, out_pl))
    mask = (u < keep).astype(x.dtype)
    return x * mask * (1.0 / keep), mask


@register("FuncDropoutExt")
def _func_dropout(call: OpCall) -> Decision:
    """mint.nn.functional.dropout(x, p, training, inplace, seed, offset): as Dropout, one output."""
    x = call.args[0]
    if len(call.args) > 3 and call.args[3]:
        raise NotImplementedError("dropout(inplace=True) on a DTensor is not supported; use inplace=False")
    dec = pointwise_rule(_with_inputs(call, (x,)), linearity=None)
    return Decision(dec.inputs, dec.outputs, kernel="func_dropout")


_keeps_uneven(_func_dropout, 1, "func_dropout")


@kernel("func_dropout")
def _func_dropout_kernel(mesh: Any, decision: Decision, x: Any, p: Any = 0.5, training: Any = True,
                         *rest: Any) -> Tensor:
    x = C._plain(x)
    if not training or float(p) == 0.0:
        return x * 1.0  # a new tensor, as the op returns one
    keep = 1.0 - float(p)
    out_pl = decision.outputs[0]
    assert out_pl is not None
    gshape = decision.out_shape or global_shape(tuple(Tensor.shape.fget(x)), mesh.shape, out_pl)
    mask = (Tensor(rng.uniform_local(mesh, gshape, out_pl)) < keep).astype(x.dtype)
    return x * mask * (1.0 / keep) if keep > 0 else x * mask


# ---------------------------------------------------------------- matrix products
@register("MatMul", "BatchMatMul")
def _matmul(call: OpCall) -> Decision:
    a, b = call.args[0], call.args[1]
    ta = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("transpose_a", False))
    tb = bool(call.args[3]) if len(call.args) > 3 else bool(call.kwargs.get("transpose_b", False))
    return einsum_rule(call, matmul_equation(a, b, ta, tb))


@register("MatMulExt", "Matmul")
def _matmul_ext(call: OpCall) -> Decision:
    a, b = call.args[0], call.args[1]
    if a.ndim > 2 and b.ndim > 2 and a.shape[:-2] != b.shape[:-2]:
        return _replicated(call)
    return einsum_rule(call, matmul_equation(a, b, False, False))


@register("Dense")
def _dense(call: OpCall) -> Decision:
    """Dense(x, weight[out, in], bias): x @ weight.T + bias."""
    x, w = call.args[0], call.args[1]
    bias = call.args[2] if len(call.args) > 2 else None
    batch = batch_labels(x.ndim - 1, "kn")
    eq = f"{batch}k,nk->{batch}n"
    if not isinstance(bias, TensorInfo):
        return einsum_rule(_with_inputs(call, (x, w)), eq)
    dec = einsum_rule(_with_inputs(call, (bias, x, w)), eq, has_bias=True)
    b_req, x_req, w_req = dec.inputs
    return Decision((x_req, w_req, b_req), dec.outputs)


# ---------------------------------------------------------------- views
@register("Reshape", "View")
def _reshape(call: OpCall) -> Decision:
    x = call.args[0]
    rest = call.args[1:]
    sizes = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    dec = view_rule(OpCall(call.name, call.mesh_shape, (x, sizes)))
    if dec.args is None:
        return Decision(dec.inputs, dec.outputs, args=(x, tuple(sizes)))
    return Decision(dec.inputs, dec.outputs, args=(dec.args[0], tuple(dec.args[1])))


register("TransposeExtView", "TransposeExt", "Swapaxes")(transpose_rule)
register("Transpose", "TransposeView")(lambda c: permute_rule(c, list(c.args[1])))
register("ExpandDims", "Unsqueeze")(unsqueeze_rule)


@register("Stack", "StackExt")
def _stack(call: OpCall) -> Decision:
    """stack(tensors, axis), run as a kernel: MindSpore's CPU backend has no StackExt kernel."""
    axis = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", call.kwargs.get("axis", 0))
    dec = stack_rule(call, list(call.args[0]), int(axis))
    return Decision(dec.inputs, dec.outputs, kernel="stack")


@kernel("stack")
def _stack_kernel(mesh: Any, decision: Decision, tensors: Any, axis: Any = 0, **kwargs: Any) -> Tensor:
    # The locals may be the DTensor objects themselves (fallback is off here): stack plain views.
    return ops.stack([C._plain(t) for t in tensors], int(kwargs.get("dim", kwargs.get("axis", axis))))


@register("Concat")
def _concat(call: OpCall) -> Decision:
    axis = call.args[1] if len(call.args) > 1 else call.kwargs.get("axis", 0)
    return cat_rule(OpCall(call.name, call.mesh_shape, (list(call.args[0]), axis)))


# ---------------------------------------------------------------- reductions
def _dims(v: Any) -> list[int] | None:
    if v is None:
        return None
    return [v] if isinstance(v, int) else list(v)


def _reduce_args(call: OpCall) -> tuple[Any, list[int] | None, bool]:
    """(input, reduced dims or None for all, keepdim) of a reduction in any of its forms: the
    functional ``(x, dim, keepdim[, dtype])`` (SumExt, ReduceMax from ``ops.amax``) or the
    primitive call ``(prim, name, [x, axis, keep_dims[, skip_mode]])`` (``ops.ReduceSum()``, what
    ``ops.norm`` uses), where an empty axis means every dim."""
    inputs = _prim_inputs(call)
    x = inputs[0]
    axis = inputs[1] if len(inputs) > 1 else call.kwargs.get("dim", call.kwargs.get("axis"))
    keep = inputs[2] if len(inputs) > 2 else call.kwargs.get("keepdim", call.kwargs.get("keep_dims", False))
    dims = _dims(axis)
    if inputs is not call.args and len(inputs) > 3 and inputs[3] is True and not dims:
        raise NotImplementedError(f"{call.name}(skip_mode=True) over no axis on a DTensor is not supported")
    return x, dims, bool(keep)


def _reduce(kind: str) -> Any:
    def rule(call: OpCall) -> Decision:
        x, dims, keep = _reduce_args(call)
        dec = reduction_rule(OpCall(call.name, call.mesh_shape, (x,)), kind, dims, keep)
        if kind in ("amax", "amin"):
            return _extremum_across_ranks(dec, kind)
        return dec

    return rule


def _extremum_across_ranks(dec: Decision, kind: str) -> Decision:
    """A max/min over a sharded dim runs as the ``extremum`` kernel: the global value on every
    rank (Replicate where the rule said Partial), with MindSpore's gradient -- split evenly among
    the *global* ties across shards.  Left Partial, each rank's local backward would split the
    gradient among its own local maxima, whether or not they are the global one."""
    req, out = dec.inputs[0], dec.outputs[0]
    assert req is not None and out is not None
    across = [k for k, (r, o) in enumerate(zip(req, out)) if isinstance(r, Shard) and isinstance(o, Partial)]
    if not across:
        return dec
    rep = tuple(Replicate() if k in across else o for k, o in enumerate(out))
    return Decision(dec.inputs, (rep,), kernel=f"extremum_{kind}")


register("SumExt", "ReduceSum")(_reduce("sum"))
register("MeanExt", "ReduceMean")(_reduce("mean"))
register("ReduceMax", "Max")(_reduce("amax"))
register("ReduceMin", "Min")(_reduce("amin"))
register("ReduceAny", "Any", "AnyExt")(_reduce("any"))
register("ReduceAll", "All", "AllExt")(_reduce("all"))


@register("LpNorm")
def _lp_norm(call: OpCall) -> Decision:
    """``ops.norm(x, p, dim)``: the LpNorm primitive (its axis, p and keep_dims are attributes) is
    not a sum of per-rank parts; a sharded reduced dim is gathered, kept dims stay sharded."""
    prim, x = call.args[0], _prim_inputs(call)[0]
    attrs = getattr(prim, "attrs", {})
    dims = _dims(attrs.get("axis"))
    return gathered_reduction_rule(OpCall(call.name, call.mesh_shape, (x,)), dims, bool(attrs.get("keep_dims", False)))


class _GlobalExtremum(ms._Function):  # type: ignore[misc]
    """max/min of this rank's shard over ``axis``, reduced across the mesh dims ``across``;
    backward gives each element equal to the global extremum ``G / count``, ``count`` the number
    of such elements over every shard (MindSpore's rule for ReduceMax/ReduceMin on one process)."""

    @staticmethod
    def forward(ctx: Any, x: Any, mesh: Any, across: Any, axis: Any, keep: Any, op: Any) -> Tensor:
        with NoFallbackGuard():
            xp = C._plain(x)
            y = (ops.amax if op == "max" else ops.amin)(xp, axis, keep)
            y = reduce_over(y, mesh, across, op, C.COLLECTIVES)
        ctx.meta = (xp, y, mesh, across, axis, keep)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        xp, y, mesh, across, axis, keep = ctx.meta
        with NoFallbackGuard():
            kept = tuple(1 if d in axis else s for d, s in enumerate(Tensor.shape.fget(xp)))
            g = C._plain(grad)
            if not keep:
                y, g = y.reshape(kept), g.reshape(kept)
            hit = (xp == y).astype(ms.float32)
            count = reduce_over(hit.sum(axis, keepdim=True), mesh, across, "sum", C.COLLECTIVES)
            dx = hit * (g.astype(ms.float32) / count)
            return dx.astype(xp.dtype), None, None, None, None, None


def _extremum_kernel(op: str) -> Any:
    def run(mesh: Any, decision: Decision, *args: Any, **kwargs: Any) -> Tensor:
        call = OpCall("extremum", mesh.shape, args, kwargs)
        x, dims, keep = _reduce_args(call)
        ndim = len(Tensor.shape.fget(x))
        axis = tuple(range(ndim)) if not dims else tuple(sorted(d % ndim for d in dims))
        req, out = decision.inputs[0], decision.outputs[0]
        assert req is not None and out is not None
        across = tuple(k for k, (r, o) in enumerate(zip(req, out)) if isinstance(r, Shard) and isinstance(o, Replicate))
        return _GlobalExtremum.apply(x, mesh, across, axis, keep, op)  # type: ignore[no-any-return]

    return run


kernel("extremum_amax")(_extremum_kernel("max"))
kernel("extremum_amin")(_extremum_kernel("min"))

# ---------------------------------------------------------------- norms and softmax


@register("LayerNorm")
def _layer_norm(call: OpCall) -> Decision:
    """LayerNorm(x, gamma, beta, begin_norm_axis, begin_params_axis, eps) -> (y, mean, rstd)."""
    inputs = _prim_inputs(call)
    x = inputs[0]
    begin = int(inputs[3]) if len(inputs) > 3 else -1
    begin %= x.ndim
    return layer_norm_rule(_with_inputs(call, (x, inputs[1], inputs[2])), x.ndim - begin)


@register("Softmax", "LogSoftmax", "SoftmaxExt", "LogSoftmaxExt")
def _softmax(call: OpCall) -> Decision:
    """Softmax(x, axis): the primitive takes a tuple of one axis, the functional forms an int."""
    axis = call.args[1] if len(call.args) > 1 else call.kwargs.get("axis", call.kwargs.get("dim", -1))
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise NotImplementedError(f"{call.name} over several axes {axis} has no sharding rule")
        axis = axis[0]
    return softmax_rule(call, int(axis))


# ---------------------------------------------------------------- embedding


@register("Gather")
def _gather(call: OpCall) -> Decision:
    """Gather(table, ids, axis=0, batch_dims=0): an embedding lookup when axis is 0."""
    inputs = _prim_inputs(call)
    table, ids = inputs[0], inputs[1]
    axis = int(inputs[2]) if len(inputs) > 2 else 0
    if axis != 0 or table.ndim != 2:
        return _replicated(call)
    return embedding_rule(_with_inputs(call, (table, ids)))


@kernel("masked_embedding")
def _masked_gather(mesh: Any, decision: Decision, *args: Any, vocab: int, **kwargs: Any) -> Tensor:
    """Look up the ids in this rank's vocab rows; other ids give zero rows (a Partial sum)."""
    inputs = args[2] if len(args) == 3 and isinstance(args[1], str) else args
    table, ids = inputs[0], inputs[1]
    wpl = decision.inputs[0]
    assert wpl is not None
    rows = int(Tensor.shape.fget(table)[0])
    local_ids = ids - vocab_start(vocab, wpl, mesh.shape, mesh.get_coordinate())
    outside = mint.logical_or(local_ids < 0, local_ids >= rows)
    safe = ops.select(outside, ops.zeros_like(local_ids), local_ids)
    out = ops.gather(table, safe, 0)
    keep = mint.logical_not(outside).astype(out.dtype)
    return out * keep.reshape(tuple(Tensor.shape.fget(keep)) + (1,))


# ---------------------------------------------------------------- metadata


@register("typeof")
def _typeof(call: OpCall) -> Decision:
    """The type of a tensor (argument checks in MindSpore's nn cells): no data moves, nothing to wrap."""
    return Decision(tuple(None for _ in call.tensors()), ())


install_interceptors()
