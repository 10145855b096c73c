"""One random stream for the whole job, sliced per rank: how a backend whose generators cannot
be made to agree across ranks still draws what one process would.

MindSpore's CPU random primitives keep a private state per primitive instance, seeded per
process, so the same op on a ``Replicate`` DTensor would draw differently on each rank.  This
stream follows torch's offset-based semantics instead: a seed every rank agrees on and an offset
every rank advances alike (by the global element count of each draw).  Each rank draws the values
of the *global* tensor at that offset (numpy's Philox, counter-based) and keeps the slice its
placements select, so replicated results are identical on every rank and sharded results are the
matching slice of the single-device draw.
"""

from __future__ import annotations

import enum
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from hp_dtensor.layout.shard_geometry import local_shape_and_offset
from hp_dtensor.placement_types import Placement
from hp_dtensor.platform import current

if TYPE_CHECKING:
    from hp_dtensor.device_mesh import DeviceMesh

_state: dict[str, Any] = {"seed": None, "offset": 0}


def manual_seed(seed: int) -> None:
    """Set the job-wide stream (call with the same seed on every rank)."""
    _state.update(seed=int(seed) & 0xFFFF_FFFF_FFFF_FFFF, offset=0)


def agreed_seed() -> int:
    """The stream's seed; at first use rank 0 of the world picks one and every rank learns it
    (so call random ops on every rank, as any collective)."""
    if _state["seed"] is None:
        mine = int(np.frombuffer(os.urandom(8), np.int64)[0])
        backend = current()
        n = backend.get_world_size()
        if n > 1:
            # The stream is job-wide (not per mesh), so world rank 0's pick is everyone's seed.
            world = backend.get_or_create_group(tuple(range(n)))
            mine = backend.COLLECTIVES.gather_int_rows([[mine]], world, n, backend.get_rank())[0][0]
        _state["seed"] = int(mine) & 0xFFFF_FFFF_FFFF_FFFF
    return int(_state["seed"])


class Draw(enum.Enum):
    """The distributions the stream draws (float32 on every rank, cast by the caller)."""

    UNIFORM = "uniform"  # [0, 1)
    NORMAL = "normal"  # mean 0, std 1


def draw_local(mesh: DeviceMesh, global_shape: tuple[int, ...], placements: tuple[Placement, ...],
               kind: Draw = Draw.UNIFORM) -> np.ndarray:
    """This rank's slice of the next draw of ``global_shape`` from the stream.

    Every rank draws the global tensor at the same offset and keeps the ``torch.chunk``-style
    block its ``Shard`` placements select (uneven shards included), so the slices of all ranks tile
    the one draw; ``Replicate`` and ``Partial`` mesh dims keep the whole extent (what a ``Partial``
    term means is the caller's decision).  The offset advances by the global element count, which
    is more counter steps than either distribution consumes, so consecutive draws never overlap."""
    seed = agreed_seed()
    offset = int(_state["offset"])
    numel = int(np.prod(global_shape, dtype=np.int64))
    _state["offset"] = offset + numel
    gen = np.random.Generator(np.random.Philox(key=seed, counter=offset))
    if kind is Draw.UNIFORM:
        full = gen.random(global_shape, dtype=np.float32)
    else:
        full = gen.standard_normal(global_shape, dtype=np.float32)
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    shape, start = local_shape_and_offset(global_shape, mesh.shape, placements, coord)
    index = tuple(slice(o, o + n) for o, n in zip(start, shape))
    return np.require(full[index], requirements="C")


def uniform_local(mesh: DeviceMesh, global_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> np.ndarray:
    """Uniform [0, 1) float32 values of the next draw of ``global_shape``, this rank's slice."""
    return draw_local(mesh, global_shape, placements, Draw.UNIFORM)
