"""The local kernels some MindSpore sharding rules name (``Decision.kernel``).

Which rule each MindSpore op uses is data in ``hp_dtensor.sharding`` (no MindSpore there); where a
rule needs more than the op run on the shards -- a dropout mask from the job-wide stream, a
global max/min with its gradient, a vocab-masked lookup -- it names a kernel, and this module is
its MindSpore code.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore import Tensor, mint, ops
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.api.random_stream import uniform_local
from hp_dtensor.layout.shard_geometry import global_shape
from hp_dtensor.placement_types import Replicate, Shard
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.dispatch import kernel
from hp_dtensor.redistribute.executor import reduce_over
from hp_dtensor.sharding.embedding import vocab_start
from hp_dtensor.sharding.op_args import prim_inputs, reduce_args
from hp_dtensor.sharding.op_call import Decision, OpCall


@kernel("dropout")
def _dropout_kernel(mesh: Any, decision: Decision, *args: Any) -> tuple[Tensor, Tensor]:
    prim = args[0]
    x = C._plain(prim_inputs(OpCall("Dropout", mesh.shape, args))[0])
    keep = float(prim.attrs["keep_prob"])
    out_pl = decision.outputs[0]
    assert out_pl is not None
    gshape = decision.out_shape or global_shape(tuple(Tensor.shape.fget(x)), mesh.shape, out_pl)
    u = Tensor(uniform_local(mesh, gshape, out_pl))
    mask = (u < keep).astype(x.dtype)
    return x * mask * (1.0 / keep), mask


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
    mask = (Tensor(uniform_local(mesh, gshape, out_pl)) < keep).astype(x.dtype)
    return x * mask * (1.0 / keep) if keep > 0 else x * mask


@kernel("stack")
def _stack_kernel(mesh: Any, decision: Decision, tensors: Any, axis: Any = 0, **kwargs: Any) -> Tensor:
    # The locals may be the DTensor objects themselves (fallback is off here): stack plain views.
    return ops.stack([C._plain(t) for t in tensors], int(kwargs.get("dim", kwargs.get("axis", axis))))


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
        x, dims, keep = reduce_args(call)
        ndim = len(Tensor.shape.fget(x))
        axis = tuple(range(ndim)) if not dims else tuple(sorted(d % ndim for d in dims))
        req, out = decision.inputs[0], decision.outputs[0]
        assert req is not None and out is not None
        across = tuple(k for k, (r, o) in enumerate(zip(req, out)) if isinstance(r, Shard) and isinstance(o, Replicate))
        return _GlobalExtremum.apply(x, mesh, across, axis, keep, op)  # type: ignore[no-any-return]

    return run


kernel("extremum_amax")(_extremum_kernel("max"))
kernel("extremum_amin")(_extremum_kernel("min"))


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
