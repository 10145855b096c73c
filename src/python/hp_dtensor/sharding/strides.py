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

from hp_dtensor.placement_types import Placement, Shard


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


_cache: dict[tuple[object, ...], tuple[int, ...]] = {}


def global_strides(
    local_stride: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    """Strides of the global tensor whose shard on every rank has strides ``local_stride``
    (cached: every op output asks)."""
    key = (local_stride, mesh_shape, placements)
    out = _cache.get(key)
    if out is None:
        if len(_cache) > 4096:
            _cache.clear()
        out = _cache[key] = _scale(local_stride, mesh_shape, placements)
    return out


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
