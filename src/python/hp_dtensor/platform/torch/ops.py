"""Which sharding rule each aten op uses (importing this module registers them).

The rules themselves live in ``hp_dtensor.sharding`` and know nothing about torch; this table is
the torch-specific half: op names, argument positions, and the local kernels some rules need.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.layout.shard_geometry import local_offset, local_shape
from hp_dtensor.placement_types import Partial, Replicate, Shard
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dispatch import FOREACH_RULES, kernel, register
from hp_dtensor.redistribute.executor import reduce_over
from hp_dtensor.sharding.attention import sdpa_rule
from hp_dtensor.sharding.casts import cast_rule
from hp_dtensor.sharding.embedding import embedding_backward_rule, embedding_rule, vocab_start
from hp_dtensor.sharding.factories import like_factory_rule, new_factory_rule
from hp_dtensor.sharding.indexing import (
    along_dims_rule,
    gather_rule,
    index_select_rule,
    scatter_rule,
    slice_backward_rule,
)
from hp_dtensor.sharding.loss import (
    mse_loss_backward_rule,
    mse_loss_rule,
    nll_loss_backward_rule,
    nll_loss_rule,
)
from hp_dtensor.sharding.matrix import einsum_rule
from hp_dtensor.sharding.norms import layer_norm_backward_rule, layer_norm_rule, softmax_rule
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo
from hp_dtensor.sharding.pointwise import SCALAR_ONCE, pointwise_rule
from hp_dtensor.sharding.reductions import gathered_reduction_rule, reduction_rule, vector_norm_rule
from hp_dtensor.sharding.triangular import triangular_rule
from hp_dtensor.sharding.views import (
    cat_rule,
    expand_rule,
    permute_rule,
    select_rule,
    slice_rule,
    split_rule,
    squeeze_rule,
    stack_rule,
    transpose_rule,
    unsqueeze_rule,
    view_rule,
)

aten = torch.ops.aten

# ---------------------------------------------------------------- pointwise
_ADD_LIKE = [
    aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor, aten.copy_.default, aten.add.Scalar,
    aten.add_.Scalar, aten.sub.Scalar, aten.sub_.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
]
_MUL_LIKE = [
    aten.mul.Tensor, aten.mul_.Tensor, aten.mul.Scalar, aten.mul_.Scalar, aten.div.Scalar, aten.div_.Scalar,
    aten.neg.default, aten.neg_.default, aten.clone.default, aten.detach.default, aten.alias.default,
    aten.zero_.default, aten.view_as_real.default, aten.view_as_complex.default,
]
_DIV_LIKE = [aten.div.Tensor, aten.div_.Tensor]
_NONLINEAR = [
    aten.exp.default, aten.exp_.default, aten.log.default, aten.sqrt.default, aten.sqrt_.default,
    aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.pow_.Scalar,
    aten.silu.default, aten.silu_.default, aten.silu_backward.default, aten.gelu.default,
    aten.gelu_backward.default, aten.sigmoid.default, aten.sigmoid_.default, aten.sigmoid_backward.default,
    aten.tanh.default, aten.tanh_backward.default, aten.relu.default, aten.relu_.default,
    aten.threshold_backward.default, aten.where.self, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
    aten.lt.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.le.Scalar, aten.ge.Scalar, aten.logical_not.default,
    aten.logical_and.default, aten.abs.default, aten.clamp.default, aten.clamp_min.default,
    aten.maximum.default, aten.minimum.default, aten.lerp.Scalar, aten.lerp_.Scalar, aten.lerp_.Tensor,
    aten.addcmul.default, aten.addcmul_.default, aten.addcdiv.default, aten.addcdiv_.default,
    aten.reciprocal.default, aten.sign.default, aten.sin.default, aten.cos.default, aten.erf.default,
    aten.softplus.default, aten.softplus_backward.default, aten.log1p.default, aten.expm1.default,
    aten.fill_.Scalar, aten.native_dropout_backward.default, aten.isnan.default, aten.isinf.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.square.default, aten.sqrt.default, aten.exp2.default,
    aten.elu.default, aten.leaky_relu.default, aten.hardtanh.default, aten.clamp_max.default,
    aten.logical_or.default, aten.logical_or_.default, aten.logical_and_.default, aten.logical_xor.default,
    aten.bitwise_not.default, aten.bitwise_xor.Tensor, aten.ge.Tensor, aten.le.Tensor, aten.floor.default,
    aten.ceil.default, aten.round.default, aten.trunc.default, aten.remainder.Tensor, aten.remainder.Scalar,
    aten.fmod.Tensor, aten.fmod.Scalar, aten.div.Tensor_mode, aten.floor_divide.default, aten.nan_to_num.default,
    aten.clamp.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf, aten.isfinite.default,
    aten.log2.default, aten.log10.default, aten.atan.default, aten.tan.default, aten.sinh.default,
    aten.cosh.default, aten.asin.default, aten.acos.default, aten.atan2.default, aten.hardsigmoid.default,
    aten.mish.default, aten.logit.default, aten.xlogy.Tensor, aten.signbit.default, aten.frac.default,
    aten.sgn.default, aten.abs_.default, aten.clamp_.default, aten.clamp_min_.default, aten.exp2_.default, aten.tanh_.default,
]
_LIKE_FACTORIES = [
    aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default,
]


def _pw(linearity: str | None, n_outputs: int = 1) -> Any:
    def rule(call: OpCall) -> Decision:
        inplace = call.name.split(".")[1].endswith("_")
        return pointwise_rule(call, linearity=linearity, inplace=inplace, n_outputs=n_outputs, scalar_once=True)

    rule.uneven_pointwise = n_outputs  # type: ignore[attr-defined]  # may keep uneven shards
    return rule


def _scalar_once_kernel(pos: int) -> Any:
    def run(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> Any:
        """An affine op (x + c) on a Partial("sum"): c is added on the first rank of the partial
        mesh dims only; the others add zero (same dtype, so type promotion does not change)."""
        out_pl = decision.outputs[0]
        assert out_pl is not None
        coord = mesh.get_coordinate()
        if any(coord[k] != 0 for k, p in enumerate(out_pl) if isinstance(p, Partial) and p.reduce_op == "sum"):
            args_l = list(args)
            c = args_l[pos]
            args_l[pos] = torch.zeros_like(c) if isinstance(c, torch.Tensor) else type(c)(0)
            args = tuple(args_l)
        return func(*args, **kwargs)

    return run


for _pos in (0, 1, 2):
    kernel(f"{SCALAR_ONCE}{_pos}")(_scalar_once_kernel(_pos))


@register(aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor)
def _masked_fill(call: OpCall) -> Decision:
    """Filling with a constant is linear in a Partial input when the constant goes to one rank
    only (zeros elsewhere; the ``scalar_once_2`` kernel); vector_norm's backward fills a
    Partial(sum) in place this way."""
    inplace = call.name.split(".")[1].endswith("_")
    if isinstance(call.args[2], TensorInfo):  # a DTensor value: not linear in the filled input
        return pointwise_rule(call, inplace=inplace)
    dec = pointwise_rule(call, linearity="mul", inplace=inplace)
    out = dec.outputs[0] or ()
    if any(isinstance(p, Partial) and p.reduce_op == "sum" for p in out):
        return Decision(dec.inputs, dec.outputs, kernel=f"{SCALAR_ONCE}2")
    return dec


# Pointwise on every input: an uneven self is filled shard by shard (an in-place fill could not
# move its self to the even layout other rules see).
_masked_fill.uneven_pointwise = 1  # type: ignore[attr-defined]  # may keep uneven shards


@register(aten._to_copy.default)
def _to_copy(call: OpCall) -> Decision:
    """``.to(dtype)`` / ``.half()`` / ``.float()``: a Partial input stays Partial only through a
    cast that loses nothing (``cast_rule``); before a narrowing one it is reduced in its own dtype."""
    return cast_rule(call, call.kwargs.get("dtype"))


_to_copy.uneven_pointwise = 1  # type: ignore[attr-defined]  # may keep uneven shards


register(*_ADD_LIKE)(_pw("add"))
register(*_MUL_LIKE)(_pw("mul"))
register(*_DIV_LIKE)(_pw("div"))
register(*_NONLINEAR)(_pw(None))


register(*_LIKE_FACTORIES)(like_factory_rule)
like_factory_rule.uneven_pointwise = 1  # type: ignore[attr-defined]  # may keep uneven shards
register(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)(
    new_factory_rule
)
register(aten.new_empty_strided.default)(lambda c: new_factory_rule(c, strides_pos=2))


# ---------------------------------------------------------------- matrix products
register(aten.mm.default)(lambda c: einsum_rule(c, "mk,kn->mn"))
register(aten.bmm.default)(lambda c: einsum_rule(c, "bmk,bkn->bmn"))
register(aten.addmm.default)(lambda c: einsum_rule(c, "mk,kn->mn", has_bias=True))
register(aten.baddbmm.default)(lambda c: einsum_rule(c, "bmk,bkn->bmn", has_bias=True))
register(aten.mv.default)(lambda c: einsum_rule(c, "mk,k->m"))
register(aten.dot.default)(lambda c: einsum_rule(c, "k,k->"))

# ---------------------------------------------------------------- views
def _local_view(call: OpCall) -> Decision:
    dec = view_rule(call)
    if not any(isinstance(p, Shard) for pl in (*dec.inputs, *dec.outputs) for p in pl or ()):
        # Nothing sharded: every shard is the whole tensor laid out as the wrapper says, so the
        # op runs on it exactly as asked (and the steady state needs no rewritten arguments).
        return Decision(dec.inputs, dec.outputs)
    return Decision(dec.inputs, dec.outputs, args=dec.args, kernel="view")


@kernel("view")
def _view(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, size: Any) -> torch.Tensor:
    """The local view, or a copy when the shard's layout cannot take it (a shard of one row is
    contiguous whatever its strides say globally, and a gathered input is laid out anew)."""
    try:
        return func(x, size)
    except RuntimeError:
        return aten._unsafe_view(x.contiguous(), size)


register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)(_local_view)
register(aten.t.default, aten.transpose.int)(transpose_rule)
register(aten.permute.default)(lambda c: permute_rule(c, c.args[1]))
register(aten.unsqueeze.default)(unsqueeze_rule)
@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(call: OpCall) -> Decision:
    """Squeeze exactly the dims of global size 1: a shard may have size 1 where the tensor does not."""
    dec = squeeze_rule(call)
    t: TensorInfo = call.args[0]
    if len(call.args) > 1:
        d = call.args[1]
        asked = [d] if isinstance(d, int) else list(d)
        dims = [x % max(t.ndim, 1) for x in asked if t.ndim and t.shape[x % t.ndim] == 1]
    else:
        dims = [i for i, s in enumerate(t.shape) if s == 1]
    return Decision(dec.inputs, dec.outputs, args=(t, dims), kernel="squeeze_dims")


@kernel("squeeze_dims")
def _squeeze_dims(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return aten.squeeze.dims(x, dims) if dims else aten.alias(x)


@register(aten.select_backward.default)
def _select_backward(call: OpCall) -> Decision:
    """``select_backward(grad, input_sizes, dim, index)``: zeros with ``grad`` written at the index;
    the grad's shards move past the restored dim, the local call gets local sizes."""
    g: TensorInfo = call.args[0]
    sizes = list(call.args[1])
    d = call.args[2] % len(sizes)
    out = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= d else p for p in g.placements)
    args = list(call.args)
    args[1] = list(local_shape(tuple(sizes), call.mesh_shape, out, call.coordinate))
    return Decision((g.placements,), (out,), args=tuple(args))
register(aten.expand.default)(expand_rule)
register(aten.select.int)(select_rule)
register(aten.cat.default)(cat_rule)


register(aten.split.Tensor, aten.split_with_sizes.default)(
    lambda c: split_rule(c, c.args[2] if len(c.args) > 2 else c.kwargs.get("dim", 0))
)
register(aten.unbind.int)(lambda c: split_rule(c, c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0), True))
register(aten.slice.Tensor)(
    lambda c: slice_rule(
        c,
        c.args[1] if len(c.args) > 1 else 0,
        c.args[2] if len(c.args) > 2 else None,
        c.args[3] if len(c.args) > 3 else None,
        c.args[4] if len(c.args) > 4 else 1,
    )
)
register(aten.stack.default)(
    lambda c: stack_rule(c, list(c.args[0]), c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0))
)


# ---------------------------------------------------------------- reductions
def _dims_arg(call: OpCall, pos: int) -> list[int] | None:
    if len(call.args) > pos:
        v = call.args[pos]
    else:
        v = call.kwargs.get("dim")
    if v is None:
        return None
    return [v] if isinstance(v, int) else list(v)


def _keepdim(call: OpCall, pos: int) -> bool:
    return bool(call.args[pos]) if len(call.args) > pos else bool(call.kwargs.get("keepdim", False))


register(aten.sum.default)(lambda c: reduction_rule(c, "sum", None, False))
register(aten.sum.dim_IntList)(lambda c: reduction_rule(c, "sum", _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.mean.default)(lambda c: reduction_rule(c, "mean", None, False))
register(aten.mean.dim)(lambda c: reduction_rule(c, "mean", _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.amax.default)(lambda c: reduction_rule(c, "amax", _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.amin.default)(lambda c: reduction_rule(c, "amin", _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.max.default)(lambda c: reduction_rule(c, "amax", None, False))
register(aten.min.default)(lambda c: reduction_rule(c, "amin", None, False))
register(aten.max.dim)(lambda c: reduction_rule(c, "max_with_indices", _dims_arg(c, 1), _keepdim(c, 2), 2))
register(aten.min.dim)(lambda c: reduction_rule(c, "min_with_indices", _dims_arg(c, 1), _keepdim(c, 2), 2))
register(aten.any.default)(lambda c: reduction_rule(c, "any", None, False))
register(aten.any.dim, aten.any.dims)(lambda c: reduction_rule(c, "any", _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.all.default)(lambda c: reduction_rule(c, "all", None, False))
register(aten.all.dim, aten.all.dims)(lambda c: reduction_rule(c, "all", _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.argmax.default)(lambda c: reduction_rule(c, "argmax", _dims_arg(c, 1), _keepdim(c, 2)))

# ---------------------------------------------------------------- norms and softmax
register(aten.native_layer_norm.default)(lambda c: layer_norm_rule(c, len(c.args[1])))
register(aten.native_layer_norm_backward.default)(
    lambda c: layer_norm_backward_rule(c, len(c.args[2]), list(c.args[7]))
)
register(aten._softmax.default, aten._log_softmax.default)(lambda c: softmax_rule(c, c.args[1]))
register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)(
    lambda c: softmax_rule(c, c.args[2])
)

# ---------------------------------------------------------------- attention
register(aten._scaled_dot_product_flash_attention_for_cpu.default)(lambda c: sdpa_rule(c, 3, 2))
register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(lambda c: sdpa_rule(c, 6, 3))

# ---------------------------------------------------------------- embedding
register(aten.embedding.default)(embedding_rule)
register(aten.embedding_dense_backward.default)(lambda c: embedding_backward_rule(c, ()))


@kernel("masked_embedding")
def _masked_embedding(mesh: Any, decision: Decision, func: Any, weight: torch.Tensor, indices: torch.Tensor,
                      *rest: Any, **kw: Any) -> torch.Tensor:
    """Look up the ids in this rank's vocab rows; others give zero rows (output is Partial sum)."""
    wpl = decision.inputs[0]
    assert wpl is not None
    start = vocab_start(kw.pop("vocab"), wpl, mesh.shape, mesh.get_coordinate())
    rows = weight.shape[0]
    local_ids = indices - start
    outside = (local_ids < 0) | (local_ids >= rows)
    out = torch.nn.functional.embedding(local_ids.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0)


# ---------------------------------------------------------------- loss
def _nll_reduction(call: OpCall, pos: int) -> int:
    return int(call.args[pos]) if len(call.args) > pos else int(call.kwargs.get("reduction", 1))


register(aten.nll_loss_forward.default)(lambda c: nll_loss_rule(c, _nll_reduction(c, 3)))
register(aten.nll_loss_backward.default)(lambda c: nll_loss_backward_rule(c, _nll_reduction(c, 4)))
register(aten.nll_loss2d_forward.default)(lambda c: nll_loss_rule(c, _nll_reduction(c, 3)))


# ---------------------------------------------------------------- along one dim, indexing
def _int_arg(call: OpCall, pos: int, name: str, default: int) -> int:
    v = call.args[pos] if len(call.args) > pos else call.kwargs.get(name, default)
    return int(v)


register(aten.cumsum.default, aten.logcumsumexp.default)(
    lambda c: along_dims_rule(c, [_int_arg(c, 1, "dim", 0)], linear=c.name.startswith("aten.cumsum"))
)
register(aten.cumprod.default, aten.cummax.default, aten.cummin.default)(
    lambda c: along_dims_rule(c, [_int_arg(c, 1, "dim", 0)], linear=False,
                              n_outputs=1 if c.name.startswith("aten.cumprod") else 2)
)
register(aten.flip.default)(lambda c: along_dims_rule(c, list(c.args[1]), linear=True))
register(aten.roll.default)(
    lambda c: along_dims_rule(c, list(c.args[2]) if len(c.args) > 2 and len(c.args[2]) else
                              list(range(c.args[0].ndim)), linear=True)
)
register(aten.sort.default)(lambda c: along_dims_rule(c, [_int_arg(c, 1, "dim", -1)], linear=False, n_outputs=2))
register(aten.sort.stable)(lambda c: along_dims_rule(c, [_int_arg(c, 2, "dim", -1)], linear=False, n_outputs=2))
register(aten.topk.default)(lambda c: along_dims_rule(c, [_int_arg(c, 2, "dim", -1)], linear=False, n_outputs=2))
register(aten.slice_backward.default)(slice_backward_rule)
register(aten.index_select.default)(index_select_rule)
register(aten.gather.default)(gather_rule)
register(aten.scatter_add.default, aten.scatter_add_.default)(
    lambda c: scatter_rule(c, accumulate=True, src_is_tensor=True, index_1d=False)
)
register(aten.index_add.default, aten.index_add_.default)(
    lambda c: scatter_rule(c, accumulate=True, src_is_tensor=True, index_1d=True)
)
register(aten.scatter.src, aten.scatter_.src)(
    lambda c: scatter_rule(c, accumulate=False, src_is_tensor=True, index_1d=False)
)
register(aten.scatter.value, aten.scatter_.value)(
    lambda c: scatter_rule(c, accumulate=False, src_is_tensor=False, index_1d=False)
)
register(aten.tril.default, aten.triu.default)(triangular_rule)


@kernel("triangular")
def _triangular(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, diagonal: int,
                gshape: tuple[int, ...]) -> torch.Tensor:
    """Mask this rank's block with the diagonal moved by the block's offset in the matrix."""
    pl = decision.inputs[0]
    assert pl is not None
    off = local_offset(gshape, mesh.shape, pl, mesh.get_coordinate())
    return func(x, diagonal + off[-2] - off[-1]) if len(gshape) >= 2 else func(x, diagonal)


# ---------------------------------------------------------------- var, norms, mse
def _var_dims(call: OpCall) -> list[int] | None:
    return _dims_arg(call, 1)


def _var_keepdim(call: OpCall) -> bool:
    return bool(call.kwargs.get("keepdim", False))


register(aten.var.correction, aten.std.correction)(
    lambda c: gathered_reduction_rule(c, _var_dims(c), _var_keepdim(c))
)
register(aten.logsumexp.default)(lambda c: gathered_reduction_rule(c, _dims_arg(c, 1), _keepdim(c, 2)))
register(aten.var_mean.correction, aten.std_mean.correction)(
    lambda c: gathered_reduction_rule(c, _var_dims(c), _var_keepdim(c), 2)
)


def _norm_ord(call: OpCall) -> float:
    return float(call.args[1]) if len(call.args) > 1 else float(call.kwargs.get("ord", 2))


@kernel("vector_norm")
def _vector_norm(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, ord: Any = 2, dim: Any = None,
                 keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    """Sum |x|^ord over this rank's part, all_reduce the sums over the mesh dims that shard a
    reduced dim, take the root: the global norm on every rank from one small all_reduce."""
    pl = decision.inputs[0]
    assert pl is not None
    p = float(ord)
    red = set(range(x.ndim)) if dim is None or (not isinstance(dim, int) and len(dim) == 0) else (
        {dim % x.ndim} if isinstance(dim, int) else {d % x.ndim for d in dim}
    )
    if p == 0:
        s = (x != 0).sum(dim=tuple(sorted(red)), keepdim=keepdim).to(dtype or x.dtype)
    else:
        s = func(x, ord, dim, keepdim, dtype=dtype).pow(p)
    sharded = tuple(k for k, q in enumerate(pl) if isinstance(q, Shard) and q.dim in red)
    if sharded:
        s = reduce_over(s, mesh, sharded, "sum", C.COLLECTIVES)
    return s if p == 0 else s.pow(1.0 / p)


register(aten.linalg_vector_norm.default)(
    lambda c: vector_norm_rule(c, _norm_ord(c), _dims_arg(c, 2), _keepdim(c, 3))
)


@kernel("mse_loss")
def _mse_loss(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, y: torch.Tensor, reduction: int,
              numel: int) -> torch.Tensor:
    out = func(x, y, 2)  # this rank's sum; the output is Partial("sum") over sharded mesh dims
    return out / numel if reduction == 1 else out


@kernel("mse_loss_backward")
def _mse_loss_backward(mesh: Any, decision: Decision, func: Any, g: torch.Tensor, x: torch.Tensor,
                       y: torch.Tensor, reduction: int, numel: int) -> torch.Tensor:
    out = func(g, x, y, 2)
    return out / numel if reduction == 1 else out


register(aten.mse_loss.default)(lambda c: mse_loss_rule(c, _int_arg(c, 2, "reduction", 1)))
register(aten.mse_loss_backward.default)(lambda c: mse_loss_backward_rule(c, _int_arg(c, 3, "reduction", 1)))


# ---------------------------------------------------------------- misc
@register(aten.is_same_size.default)
def _compare(call: OpCall) -> Decision:
    infos = call.tensors()
    return Decision(tuple(infos[0].placements for _ in infos), ())


# Ops whose result is a Python value give the global answer on every rank (an ``if`` on it must send
# every rank down the same path): compare shards laid out alike, then agree with an all_reduce(min).
@register(aten.equal.default, aten.allclose.default)
def _global_compare(call: OpCall) -> Decision:
    a, b = call.tensors()[:2]
    rep = tuple(Replicate() for _ in a.placements)
    if a.shape != b.shape:
        if call.name.startswith("aten.equal"):
            return Decision((None, None), (), kernel="constant_false")
        return Decision((rep, rep), ())  # allclose broadcasts: compare whole tensors
    pl = tuple(Replicate() if isinstance(p, Partial) else p for p in a.placements)
    return Decision((pl, pl), (), kernel="all_ranks_agree")


@kernel("all_ranks_agree")
def _all_ranks_agree(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> bool:
    flag = torch.tensor([1 if func(*args, **kwargs) else 0], dtype=torch.int32)
    return bool(reduce_over(flag, mesh, tuple(range(mesh.ndim)), "min", C.COLLECTIVES).item())


@kernel("constant_false")
def _constant_false(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> bool:
    return False


@register(aten._local_scalar_dense.default, aten.is_nonzero.default)
def _python_value(call: OpCall) -> Decision:
    """``item()``/``bool()``: the one element, reduced and replicated, read on every rank."""
    t: TensorInfo = call.args[0]
    return Decision((tuple(Replicate() for _ in t.placements),), ())


def _foreach_rule(linearity: str | None) -> Any:
    def rule(call: OpCall) -> Decision:
        inplace = call.name.split(".")[1].endswith("_")
        return pointwise_rule(call, linearity=linearity, inplace=inplace)

    rule.uneven_pointwise = 1  # type: ignore[attr-defined]  # may keep uneven shards
    return rule


def _foreach_norm(call: OpCall) -> Decision:
    """``_foreach_norm`` (clip_grad_norm_ with foreach=True): each tensor gathered, so the local
    norm is the global one (correct; grads are small next to the step)."""
    infos = call.tensors()
    return Decision(tuple(tuple(Replicate() for _ in t.placements) for t in infos),
                    (tuple(Replicate() for _ in infos[0].placements),))


FOREACH_RULES["norm"] = _foreach_norm

for _base, _lin in {"add": "add", "sub": "add", "mul": "mul", "div": "div", "copy": "add", "zero": "mul",
                   "neg": "mul", "*": None}.items():
    FOREACH_RULES[_base] = _foreach_rule(_lin)
