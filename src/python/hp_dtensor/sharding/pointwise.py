"""Pointwise ops with broadcasting.

Per mesh dim: if any input is sharded on a dim that survives broadcasting, the output is sharded
on that (output) dim and every input follows it (broadcast inputs are replicated).  With no shard,
a ``Partial`` input stays ``Partial`` only through ops linear in it (``linearity``); otherwise it
is reduced first.  In-place ops keep ``self``'s placement.

Adding a constant (a Python number or a 0-d plain tensor) is affine, not linear: every rank of a
``Partial("sum")`` adding it would add it n times.  Such a call either reduces first or, where the
platform has the kernel, adds the constant on the first rank of the partial mesh dims only
(``Partial("avg")`` needs nothing: the mean of ``x_i + c`` is ``mean(x_i) + c``).
"""

from __future__ import annotations

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import inplace_by_name, prim_inputs, with_inputs
from hp_dtensor.sharding.op_call import (
    Decision,
    OpCall,
    OpRules,
    Rule,
    TensorInfo,
    cheapest,
    keeps_uneven,
    per_mesh_dim,
    replicated_rule,
)


def _out_shape(infos: list[TensorInfo]) -> tuple[int, ...]:
    ndim = max((t.ndim for t in infos), default=0)
    shape = [1] * ndim
    for t in infos:
        for i, s in enumerate(t.shape):
            j = i + ndim - t.ndim
            if s != 1:
                shape[j] = s
    return tuple(shape)


def _follow(t: TensorInfo, out_dim: int, out_ndim: int, out_shape: tuple[int, ...]) -> Placement:
    """Placement for input ``t`` when the output is sharded on ``out_dim``."""
    d = out_dim - (out_ndim - t.ndim)
    if d >= 0 and t.shape[d] == out_shape[out_dim]:
        return Shard(d)
    return Replicate()


SCALAR_ONCE = "scalar_once_"  # kernel name prefix, + the position of the constant operand (0 or 1)


def constant_operand(call: OpCall) -> int | None:
    """Position of an operand among the first two arguments that is not a DTensor (a number or a
    0-d plain tensor), else None."""
    for i, a in enumerate(call.args[:2]):
        if not isinstance(a, TensorInfo) and a is not None:
            return i
    return None


def pointwise_rule(
    call: OpCall,
    *,
    linearity: str | None = None,
    inplace: bool = False,
    n_outputs: int = 1,
    scalar_once: bool = False,
) -> Decision:
    """``linearity`` says how a ``Partial`` input may flow through the op without reduction:
    ``"add"`` (linear in all inputs jointly: every input becomes Partial), ``"mul"`` (linear in any
    one input while the others are Replicate), ``"div"`` (linear in the first argument only),
    ``None`` (not linear: Partial inputs are reduced first).  ``scalar_once``: the platform has the
    ``scalar_once_<pos>`` kernels, so an ``"add"`` with a constant operand keeps ``Partial("sum")``."""
    if linearity == "div" and not isinstance(call.args[0], TensorInfo):
        linearity = None  # c / x is not linear in x
    const = constant_operand(call) if linearity == "add" else None
    dec = _pointwise(call, linearity, inplace, n_outputs, const is not None and not scalar_once)
    if const is not None and any(
        isinstance(p, Partial) and p.reduce_op == "sum" for p in dec.outputs[0] or ()
    ):
        return Decision(dec.inputs, dec.outputs, kernel=f"{SCALAR_ONCE}{const}")
    return dec


def _pointwise(
    call: OpCall, linearity: str | None, inplace: bool, n_outputs: int, no_partial_sum: bool
) -> Decision:
    infos = call.tensors()
    out_shape = _out_shape(infos)
    out_ndim = len(out_shape)

    def choose(k: int, cur: list[Placement]) -> tuple[list[Placement], list[Placement]]:
        n = call.mesh_shape[k]
        if inplace:
            self_p = cur[0]
            if isinstance(self_p, Shard):
                od = self_p.dim + (out_ndim - infos[0].ndim)
                return [_follow(t, od, out_ndim, out_shape) for t in infos], [self_p] * n_outputs
            if isinstance(self_p, Replicate):
                return [Replicate() for _ in infos], [Replicate()] * n_outputs
            assert isinstance(self_p, Partial)
            req = None if no_partial_sum and self_p.reduce_op == "sum" else _partial_inputs(
                cur, linearity, self_p, force_first=True
            )
            if req is None:
                raise ValueError(
                    f"in-place {call.name} on a {self_p!r} tensor cannot be computed without reducing it "
                    f"first; call .redistribute(placements=[Replicate()]) before the op"
                )
            return req, [self_p] * n_outputs
        cands: list[tuple[list[Placement], list[Placement]]] = []
        for i, t in enumerate(infos):
            p = cur[i]
            if isinstance(p, Shard):
                od = p.dim + (out_ndim - t.ndim)
                cands.append(([_follow(u, od, out_ndim, out_shape) for u in infos], [Shard(od)] * n_outputs))
        partials = [p for p in cur if isinstance(p, Partial)]
        if partials and not (no_partial_sum and partials[0].reduce_op == "sum"):
            req = _partial_inputs(cur, linearity, partials[0], force_first=False)
            if req is not None:
                cands.append((req, [partials[0]] * n_outputs))
        cands.append(([Replicate() for _ in infos], [Replicate()] * n_outputs))
        return cheapest(cands, cur, infos, n)

    return per_mesh_dim(call, choose, n_outputs)


def _partial_inputs(
    cur: list[Placement], linearity: str | None, target: Partial, *, force_first: bool
) -> list[Placement] | None:
    """Required inputs for a ``target`` Partial output, or None when the op is not linear there."""
    if linearity is None or target.reduce_op not in ("sum", "avg"):
        return None
    if any(isinstance(p, Partial) and p != target for p in cur):
        return None
    if linearity == "add":
        return [target for _ in cur]
    n_partial = sum(isinstance(p, Partial) for p in cur)
    if linearity == "mul" and n_partial == 1:
        return [p if isinstance(p, Partial) else Replicate() for p in cur]
    if linearity == "div" and isinstance(cur[0], Partial) and n_partial == 1:
        return [target] + [Replicate() for _ in cur[1:]]
    if force_first and linearity == "mul" and isinstance(cur[0], Partial):
        return [target] + [Replicate() for _ in cur[1:]]
    return None


# ---------------------------------------------------------------- families and ops, as the backends name them
def pointwise_family(linearity: str | None, n_outputs: int = 1, *, scalar_once: bool = True) -> Rule:
    """The rule of a family of aten pointwise ops of one ``linearity`` (in-place forms told by
    name), which may keep uneven shards."""

    def rule(call: OpCall) -> Decision:
        return pointwise_rule(
            call, linearity=linearity, inplace=inplace_by_name(call), n_outputs=n_outputs, scalar_once=scalar_once
        )

    return keeps_uneven(rule, n_outputs)


def inputs_pointwise_family(linearity: str | None) -> Rule:
    """The rule of a family of pointwise ops on a primitive call's inputs (or the arguments),
    which may keep uneven shards."""

    def rule(call: OpCall) -> Decision:
        return pointwise_rule(with_inputs(call, prim_inputs(call)), linearity=linearity)

    return keeps_uneven(rule)


def masked_fill_rule(call: OpCall) -> Decision:
    """``masked_fill(x, mask, value)``: filling with a constant is linear in a Partial input when
    the constant goes to one rank only (zeros elsewhere; the ``scalar_once_2`` kernel); vector_norm's
    backward fills a Partial(sum) in place this way.  Pointwise on every input: an uneven self is
    filled shard by shard (an in-place fill could not move its self to the even layout other rules
    see)."""
    inplace = inplace_by_name(call)
    if isinstance(call.args[2], TensorInfo):  # a DTensor value: not linear in the filled input
        return pointwise_rule(call, inplace=inplace)
    dec = pointwise_rule(call, linearity="mul", inplace=inplace)
    out = dec.outputs[0] or ()
    if any(isinstance(p, Partial) and p.reduce_op == "sum" for p in out):
        return Decision(dec.inputs, dec.outputs, kernel=f"{SCALAR_ONCE}2")
    return dec


keeps_uneven(masked_fill_rule)


def add_sub_rule(call: OpCall) -> Decision:
    """x + y on a backend without the ``scalar_once`` kernels: it stays Partial only when both
    operands are DTensors -- a Python number or a plain scalar tensor would be added once per rank,
    so a Partial operand is reduced first."""
    inputs = prim_inputs(call)
    linear = all(isinstance(x, TensorInfo) for x in inputs[:2])
    return pointwise_rule(with_inputs(call, inputs), linearity="add" if linear else None)


def div_rule(call: OpCall) -> Decision:
    """x / y is linear in x only: a number over a DTensor is not."""
    inputs = prim_inputs(call)
    linear = bool(inputs) and isinstance(inputs[0], TensorInfo)
    return pointwise_rule(with_inputs(call, inputs), linearity="div" if linear else None)


keeps_uneven(add_sub_rule)
keeps_uneven(div_rule)


def bias_add_rule(call: OpCall) -> Decision:
    """BiasAdd(x, b): pointwise over the trailing dim of a 2-D x; NCHW inputs (the bias broadcast
    on dim 1, not the trailing dim) compute on whole tensors."""
    x, b = prim_inputs(call)[:2]
    if x.ndim != 2:
        return replicated_rule(call)
    return pointwise_rule(with_inputs(call, (x, b)), linearity="add")


def dropout_rule(call: OpCall) -> Decision:
    """Dropout(x) -> (y, mask): pointwise on x (a Partial is reduced first: dropping terms is not
    dropping the sum), run by the platform's ``dropout`` kernel, which draws the mask from the
    job-wide stream."""
    x = prim_inputs(call)[0]
    dec = pointwise_rule(with_inputs(call, (x,)), linearity=None, n_outputs=2)
    return Decision(dec.inputs, dec.outputs, kernel="dropout")


def func_dropout_rule(call: OpCall) -> Decision:
    """``dropout(x, p, training, inplace, ...)``: as ``dropout_rule``, one output, the
    ``func_dropout`` kernel; in-place dropout is refused."""
    x = call.args[0]
    if len(call.args) > 3 and call.args[3]:
        raise NotImplementedError("dropout(inplace=True) on a DTensor is not supported; use inplace=False")
    dec = pointwise_rule(with_inputs(call, (x,)), linearity=None)
    return Decision(dec.inputs, dec.outputs, kernel="func_dropout")


keeps_uneven(dropout_rule, 2, "dropout")
keeps_uneven(func_dropout_rule, 1, "func_dropout")


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("masked_fill.Scalar masked_fill_.Scalar masked_fill.Tensor masked_fill_.Tensor", masked_fill_rule)
ATEN_OPS.add("""
    add.Tensor sub.Tensor add_.Tensor sub_.Tensor copy_ add.Scalar add_.Scalar sub.Scalar sub_.Scalar
    rsub.Scalar rsub.Tensor
""", pointwise_family("add"))
ATEN_OPS.add("""
    mul.Tensor mul_.Tensor mul.Scalar mul_.Scalar div.Scalar div_.Scalar neg neg_ clone detach alias
    zero_ view_as_real view_as_complex
""", pointwise_family("mul"))
ATEN_OPS.add("div.Tensor div_.Tensor", pointwise_family("div"))
ATEN_OPS.add("""
    exp exp_ log sqrt sqrt_ rsqrt pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar pow_.Scalar silu silu_
    silu_backward gelu gelu_backward sigmoid sigmoid_ sigmoid_backward tanh tanh_backward relu relu_
    threshold_backward where.self eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar gt.Tensor
    gt.Scalar le.Scalar ge.Scalar logical_not logical_and abs clamp clamp_min maximum minimum
    lerp.Scalar lerp_.Scalar lerp_.Tensor addcmul addcmul_ addcdiv addcdiv_ reciprocal sign sin cos erf
    softplus softplus_backward log1p expm1 fill_.Scalar native_dropout_backward isnan isinf
    bitwise_and.Tensor bitwise_or.Tensor square exp2 elu leaky_relu hardtanh clamp_max logical_or
    logical_or_ logical_and_ logical_xor bitwise_not bitwise_xor.Tensor ge.Tensor le.Tensor floor ceil
    round trunc remainder.Tensor remainder.Scalar fmod.Tensor fmod.Scalar div.Tensor_mode floor_divide
    nan_to_num clamp.Tensor where.ScalarOther where.ScalarSelf isfinite log2 log10 atan tan sinh cosh
    asin acos atan2 hardsigmoid mish logit xlogy.Tensor signbit frac sgn abs_ clamp_ clamp_min_ exp2_
    tanh_
""", pointwise_family(None))

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("Add AddExt Sub SubExt", add_sub_rule)
MINDSPORE_OPS.add("Div RealDiv", div_rule)
MINDSPORE_OPS.add("AddN", inputs_pointwise_family("add"))
MINDSPORE_OPS.add("Mul Muls Neg Contiguous Clone Identity Divs", inputs_pointwise_family("mul"))
MINDSPORE_OPS.add("""
    AddScalar SubScalar ReLU SiLU Sigmoid Tanh Exp Log Sqrt Rsqrt Square Pow PowTensorScalar GeLU Erf
    Abs Maximum Minimum Equal NotEqual Less LessEqual Greater GreaterEqual Select Softplus LogicalNot
    Cos Sin Reciprocal ClampScalar OnesLike ZerosLike LeakyReLUExt FastGeLU
""", inputs_pointwise_family(None))
MINDSPORE_OPS.add("BiasAdd", bias_add_rule)
# The dropout masks come from the job-wide stream (the platform's dropout kernels).
MINDSPORE_OPS.add("Dropout", dropout_rule)
MINDSPORE_OPS.add("FuncDropoutExt", func_dropout_rule)
