"""The local kernels some aten sharding rules name (``Decision.kernel``).

Which rule each aten op uses is data in ``hp_dtensor.sharding`` (no torch there); where a rule
needs more than the op run on the shards -- a constant added on one rank only, a vocab-masked
lookup, a norm reduced across ranks -- it names a kernel, and this module is its torch code.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.layout.shard_geometry import local_offset
from hp_dtensor.placement_types import Partial, Shard
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.dispatch import kernel
from hp_dtensor.redistribute.executor import reduce_over
from hp_dtensor.sharding.embedding import vocab_start
from hp_dtensor.sharding.op_call import Decision
from hp_dtensor.sharding.pointwise import SCALAR_ONCE

aten = torch.ops.aten


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


@kernel("view")
def _view(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, size: Any) -> torch.Tensor:
    """The local view, or a copy when the shard's layout cannot take it (a shard of one row is
    contiguous whatever its strides say globally, and a gathered input is laid out anew)."""
    try:
        return func(x, size)
    except RuntimeError:
        return aten._unsafe_view(x.contiguous(), size)


@kernel("squeeze_dims")
def _squeeze_dims(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return aten.squeeze.dims(x, dims) if dims else aten.alias(x)


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


@kernel("triangular")
def _triangular(mesh: Any, decision: Decision, func: Any, x: torch.Tensor, diagonal: int,
                gshape: tuple[int, ...]) -> torch.Tensor:
    """Mask this rank's block with the diagonal moved by the block's offset in the matrix."""
    pl = decision.inputs[0]
    assert pl is not None
    off = local_offset(gshape, mesh.shape, pl, mesh.get_coordinate())
    return func(x, diagonal + off[-2] - off[-1]) if len(gshape) >= 2 else func(x, diagonal)


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


@kernel("all_ranks_agree")
def _all_ranks_agree(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> bool:
    flag = torch.tensor([1 if func(*args, **kwargs) else 0], dtype=torch.int32)
    return bool(reduce_over(flag, mesh, tuple(range(mesh.ndim)), "min", C.COLLECTIVES).item())


@kernel("constant_false")
def _constant_false(mesh: Any, decision: Decision, func: Any, *args: Any, **kwargs: Any) -> bool:
    return False
