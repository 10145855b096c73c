"""Global strides of a DTensor from its local shard's layout.

The wrapper must report strides that tell the truth about the local data: composite ops
(``flatten``, ``reshape``, ``contiguous``, attention) pick ``view`` or a copy from the wrapper's
strides, and a ``view`` the local shard cannot take raises, or worse, a kernel reads the wrong
elements.  The global layout is the local one scaled up: a dim laid out outside a sharded dim
(stride at least as large) spans ``mesh size`` times more elements, as ``torch.distributed.tensor``
computes it.  The answer depends only on shapes, placements and local strides, so every rank with
the same local layout reports the same strides and composite ops take the same path everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.layout.shard_geometry import is_even
from hp_dtensor.placement_types import Placement, Shard


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


_cache: dict[tuple[object, ...], tuple[int, ...]] = {}


def global_strides(
    local_stride: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    local_contiguous: bool,
) -> tuple[int, ...]:
    """Strides of the global tensor of ``shape`` whose shard on every rank has strides
    ``local_stride`` (cached: every op output asks).

    Unevenly sharded tensors have shards of different sizes, and a dim of size 0 or 1 takes any
    stride, so scaling each rank's own strides would give each rank other global strides, and
    composite ops (``reshape``, ``contiguous``, autograd's gradient layout check) other paths, some
    with collectives: a hang.  Their strides are those of a dense ``shape``: contiguous when the
    shard is (``local_contiguous``, torch's test, blind to size-1 dims and empty shards), else in
    the dim order of the local strides."""
    key = (local_stride, mesh_shape, placements, shape, local_contiguous)
    out = _cache.get(key)
    if out is None:
        if len(_cache) > 4096:
            _cache.clear()
        if is_even(shape, mesh_shape, placements):
            out = _scale(local_stride, mesh_shape, placements)
        elif local_contiguous:
            out = contiguous_strides(shape)
        else:
            out = _dense_in_order(local_stride, shape)
        _cache[key] = out
    return out


def _dense_in_order(local_stride: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    order = sorted(range(len(shape)), key=lambda i: (-local_stride[i], i))  # outermost first
    strides = [0] * len(shape)
    step = 1
    for i in reversed(order):
        if local_stride[i] == 0:
            continue  # a broadcast dim stays broadcast
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


def _scale(
    local_stride: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    stride = list(local_stride)
    for k, p in enumerate(placements):
        if isinstance(p, Shard):
            n = mesh_shape[k]
            ref = stride[p.dim]
            for i in range(len(stride)):
                if i != p.dim and stride[i] >= ref and stride[i] != 0:
                    stride[i] *= n
    return tuple(stride)
