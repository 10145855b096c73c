"""Normalizations and softmax: the normalized dims must be whole on every rank.

Shards on the leading (batch/sequence) dims flow through.  In backward the weight and bias
gradients sum over those leading dims, so a leading-dim shard makes them ``Partial("sum")``
(a Replicate norm weight under sequence parallel gets a Partial gradient).
"""

from __future__ import annotations

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import prim_inputs, with_inputs
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo


def _input_req(t: TensorInfo, first_norm_dim: int) -> tuple[Placement, ...]:
    return tuple(
        p if isinstance(p, Shard) and p.dim < first_norm_dim else Replicate() for p in t.placements
    )


def _stat_placements(req: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return req  # mean/rstd keep the leading dims (normalized dims become size 1)


def _param_grad(req: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in req)


def layer_norm_rule(call: OpCall, normalized_ndim: int) -> Decision:
    """native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)."""
    infos = call.tensors()
    x = infos[0]
    req = _input_req(x, x.ndim - normalized_ndim)
    ins = (req,) + tuple(tuple(Replicate() for _ in x.placements) for _ in infos[1:])
    return Decision(ins, (req, _stat_placements(req), _stat_placements(req)))


def layer_norm_backward_rule(call: OpCall, normalized_ndim: int, output_mask: list[bool]) -> Decision:
    """native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)."""
    infos = call.tensors()
    x = infos[1]
    req = _input_req(x, x.ndim - normalized_ndim)
    ins: list[tuple[Placement, ...]] = [req, req, req, req]
    ins += [tuple(Replicate() for _ in x.placements) for _ in infos[4:]]
    outs: list[tuple[Placement, ...] | None] = [req if output_mask[0] else None]
    outs += [_param_grad(req) if m else None for m in output_mask[1:3]]
    return Decision(tuple(ins), tuple(outs))


def rms_norm_rule(call: OpCall, normalized_ndim: int, n_outputs: int) -> Decision:
    """_fused_rms_norm(input, normalized_shape, weight, eps) -> (out, rstd)."""
    infos = call.tensors()
    x = infos[0]
    req = _input_req(x, x.ndim - normalized_ndim)
    ins = (req,) + tuple(tuple(Replicate() for _ in x.placements) for _ in infos[1:])
    return Decision(ins, tuple(req for _ in range(n_outputs)))


def rms_norm_backward_rule(call: OpCall, normalized_ndim: int, output_mask: list[bool]) -> Decision:
    """_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, mask)."""
    infos = call.tensors()
    x = infos[1]
    req = _input_req(x, x.ndim - normalized_ndim)
    ins: list[tuple[Placement, ...]] = [req, req, req]
    ins += [tuple(Replicate() for _ in x.placements) for _ in infos[3:]]
    outs: list[tuple[Placement, ...] | None] = [req if output_mask[0] else None]
    outs += [_param_grad(req) if output_mask[1] else None]
    return Decision(tuple(ins), tuple(outs))


def softmax_rule(call: OpCall, dim: int, n_tensor_inputs: int = 1) -> Decision:
    """softmax / log_softmax and their backward: the softmax dim is gathered, other shards flow.
    Partial inputs are reduced (softmax is not linear)."""
    infos = call.tensors()
    ref = infos[0]
    d = dim % max(ref.ndim, 1)
    req = tuple(p if isinstance(p, Shard) and p.dim != d else Replicate() for p in ref.placements)
    return Decision(tuple(req for _ in infos), (req,))


def layer_norm_axis_rule(call: OpCall) -> Decision:
    """``LayerNorm(x, gamma, beta, begin_norm_axis, begin_params_axis, eps) -> (y, mean, rstd)``:
    the dims from ``begin_norm_axis`` on are normalized."""
    inputs = prim_inputs(call)
    x = inputs[0]
    begin = int(inputs[3]) if len(inputs) > 3 else -1
    begin %= x.ndim
    return layer_norm_rule(with_inputs(call, (x, inputs[1], inputs[2])), x.ndim - begin)


def softmax_axis_rule(call: OpCall) -> Decision:
    """``Softmax(x, axis)``: the primitive takes a tuple of one axis, the functional forms an int
    (positional or ``axis``/``dim``)."""
    axis = call.args[1] if len(call.args) > 1 else call.kwargs.get("axis", call.kwargs.get("dim", -1))
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise NotImplementedError(f"{call.name} over several axes {axis} has no sharding rule")
        axis = axis[0]
    return softmax_rule(call, int(axis))


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("native_layer_norm", lambda c: layer_norm_rule(c, len(c.args[1])))
ATEN_OPS.add("native_layer_norm_backward", lambda c: layer_norm_backward_rule(c, len(c.args[2]), list(c.args[7])))
ATEN_OPS.add("_softmax _log_softmax", lambda c: softmax_rule(c, c.args[1]))
ATEN_OPS.add("_softmax_backward_data _log_softmax_backward_data", lambda c: softmax_rule(c, c.args[2]))

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("LayerNorm", layer_norm_axis_rule)
MINDSPORE_OPS.add("Softmax LogSoftmax SoftmaxExt LogSoftmaxExt", softmax_axis_rule)
