"""Which sharding rule each aten op uses (importing this module registers them).

The rules themselves, and the readers of aten's argument positions, live in
``hp_dtensor.sharding`` and know nothing about torch; this table is the torch-specific half: op
names, and the local kernels some rules need.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.layout.shard_geometry import local_offset
from hp_dtensor.placement_types import Partial, Shard
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dispatch import FOREACH_RULES, kernel, register
from hp_dtensor.redistribute.executor import reduce_over
from hp_dtensor.sharding.attention import sdpa_rule
from hp_dtensor.sharding.casts import dtype_kwarg_cast_rule
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
from hp_dtensor.sharding.op_args import dims_arg, float_arg, int_arg, keepdim_arg
from hp_dtensor.sharding.op_call import Decision, Rule, keeps_uneven, sees_uneven
from hp_dtensor.sharding.pointwise import SCALAR_ONCE, masked_fill_rule, pointwise_family
from hp_dtensor.sharding.python_values import (
    global_compare_rule,
    python_value_rule,
    same_layout_rule,
)
from hp_dtensor.sharding.reductions import (
    foreach_norm_rule,
    gathered_reduction_rule,
    reduction_rule,
    uneven_reduction_rule,
    vector_norm_rule,
)
from hp_dtensor.sharding.triangular import triangular_rule
from hp_dtensor.sharding.views import (
    cat_rule,
    expand_rule,
    local_view_rule,
    permute_rule,
    select_backward_rule,
    select_rule,
    slice_rule,
    split_rule,
    squeeze_dims_rule,
    stack_rule,
    transpose_rule,
    unsqueeze_rule,
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


register(aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor)(
    masked_fill_rule
)
register(aten._to_copy.default)(dtype_kwarg_cast_rule)
register(*_ADD_LIKE)(pointwise_family("add"))
register(*_MUL_LIKE)(pointwise_family("mul"))
register(*_DIV_LIKE)(pointwise_family("div"))
register(*_NONLINEAR)(pointwise_family(None))
register(*_LIKE_FACTORIES)(keeps_uneven(like_factory_rule))
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
@kernel("view")
def _view(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, size: Any) -> torch.Tensor:
    """The local view, or a copy when the shard's layout cannot take it (a shard of one row is
    contiguous whatever its strides say globally, and a gathered input is laid out anew)."""
    try:
        return func(x, size)
    except RuntimeError:
        return aten._unsafe_view(x.contiguous(), size)


register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)(local_view_rule)
register(aten.t.default, aten.transpose.int)(transpose_rule)
register(aten.permute.default)(lambda c: permute_rule(c, c.args[1]))
register(aten.unsqueeze.default)(unsqueeze_rule)
register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)(squeeze_dims_rule)


@kernel("squeeze_dims")
def _squeeze_dims(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return aten.squeeze.dims(x, dims) if dims else aten.alias(x)


register(aten.select_backward.default)(select_backward_rule)
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
def _over_dims(kind: str) -> Rule:
    """A ``kind`` reduction ``(x, dims, keepdim)``, kept shard by shard on an unevenly sharded
    input whose sharded dims it does not reduce."""
    return sees_uneven(
        lambda c: reduction_rule(c, kind, dims_arg(c, 1), keepdim_arg(c, 2)),
        lambda c: uneven_reduction_rule(c, dims_arg(c, 1), keepdim_arg(c, 2)),
    )


register(aten.sum.default)(lambda c: reduction_rule(c, "sum", None, False))
register(aten.sum.dim_IntList)(_over_dims("sum"))
register(aten.mean.default)(lambda c: reduction_rule(c, "mean", None, False))
register(aten.mean.dim)(_over_dims("mean"))
register(aten.amax.default)(_over_dims("amax"))
register(aten.amin.default)(_over_dims("amin"))
register(aten.max.default)(lambda c: reduction_rule(c, "amax", None, False))
register(aten.min.default)(lambda c: reduction_rule(c, "amin", None, False))
register(aten.max.dim)(lambda c: reduction_rule(c, "max_with_indices", dims_arg(c, 1), keepdim_arg(c, 2), 2))
register(aten.min.dim)(lambda c: reduction_rule(c, "min_with_indices", dims_arg(c, 1), keepdim_arg(c, 2), 2))
register(aten.any.default)(lambda c: reduction_rule(c, "any", None, False))
register(aten.any.dim, aten.any.dims)(lambda c: reduction_rule(c, "any", dims_arg(c, 1), keepdim_arg(c, 2)))
register(aten.all.default)(lambda c: reduction_rule(c, "all", None, False))
register(aten.all.dim, aten.all.dims)(lambda c: reduction_rule(c, "all", dims_arg(c, 1), keepdim_arg(c, 2)))
register(aten.argmax.default)(lambda c: reduction_rule(c, "argmax", dims_arg(c, 1), keepdim_arg(c, 2)))

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
register(aten.nll_loss_forward.default)(lambda c: nll_loss_rule(c, int_arg(c, 3, "reduction", 1)))
register(aten.nll_loss_backward.default)(lambda c: nll_loss_backward_rule(c, int_arg(c, 4, "reduction", 1)))
register(aten.nll_loss2d_forward.default)(lambda c: nll_loss_rule(c, int_arg(c, 3, "reduction", 1)))


# ---------------------------------------------------------------- along one dim, indexing
register(aten.cumsum.default, aten.logcumsumexp.default)(
    lambda c: along_dims_rule(c, [int_arg(c, 1, "dim", 0)], linear=c.name.startswith("aten.cumsum"))
)
register(aten.cumprod.default, aten.cummax.default, aten.cummin.default)(
    lambda c: along_dims_rule(c, [int_arg(c, 1, "dim", 0)], linear=False,
                              n_outputs=1 if c.name.startswith("aten.cumprod") else 2)
)
register(aten.flip.default)(lambda c: along_dims_rule(c, list(c.args[1]), linear=True))
register(aten.roll.default)(
    lambda c: along_dims_rule(c, list(c.args[2]) if len(c.args) > 2 and len(c.args[2]) else
                              list(range(c.args[0].ndim)), linear=True)
)
register(aten.sort.default)(lambda c: along_dims_rule(c, [int_arg(c, 1, "dim", -1)], linear=False, n_outputs=2))
register(aten.sort.stable)(lambda c: along_dims_rule(c, [int_arg(c, 2, "dim", -1)], linear=False, n_outputs=2))
register(aten.topk.default)(lambda c: along_dims_rule(c, [int_arg(c, 2, "dim", -1)], linear=False, n_outputs=2))
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
# var/std take keepdim by keyword only.
register(aten.var.correction, aten.std.correction)(
    lambda c: gathered_reduction_rule(c, dims_arg(c, 1), bool(c.kwargs.get("keepdim", False)))
)
register(aten.logsumexp.default)(lambda c: gathered_reduction_rule(c, dims_arg(c, 1), keepdim_arg(c, 2)))
register(aten.var_mean.correction, aten.std_mean.correction)(
    lambda c: gathered_reduction_rule(c, dims_arg(c, 1), bool(c.kwargs.get("keepdim", False)), 2)
)


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
    lambda c: vector_norm_rule(c, float_arg(c, 1, "ord", 2), dims_arg(c, 2), keepdim_arg(c, 3))
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


register(aten.mse_loss.default)(lambda c: mse_loss_rule(c, int_arg(c, 2, "reduction", 1)))
register(aten.mse_loss_backward.default)(lambda c: mse_loss_backward_rule(c, int_arg(c, 3, "reduction", 1)))


# ---------------------------------------------------------------- Python values
register(aten.is_same_size.default)(same_layout_rule)
register(aten.equal.default, aten.allclose.default)(global_compare_rule)
register(aten._local_scalar_dense.default, aten.is_nonzero.default)(python_value_rule)


@kernel("all_ranks_agree")
def _all_ranks_agree(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> bool:
    flag = torch.tensor([1 if func(*args, **kwargs) else 0], dtype=torch.int32)
    return bool(reduce_over(flag, mesh, tuple(range(mesh.ndim)), "min", C.COLLECTIVES).item())


@kernel("constant_false")
def _constant_false(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> bool:
    return False


# ---------------------------------------------------------------- foreach, by base op name
FOREACH_RULES["norm"] = foreach_norm_rule

for _base, _lin in {"add": "add", "sub": "add", "mul": "mul", "div": "div", "copy": "add", "zero": "mul",
                   "neg": "mul", "*": None}.items():
    FOREACH_RULES[_base] = pointwise_family(_lin, scalar_once=False)
