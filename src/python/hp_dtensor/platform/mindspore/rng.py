"""Random values for DTensor ops on MindSpore: one stream for the whole job, sliced per rank.

MindSpore's CPU random primitives keep a private state per primitive instance, seeded per
process, so the same op on a ``Replicate`` DTensor draws differently on each rank unless the user
seeded every rank alike.  Here a random op on a DTensor draws from one job-wide stream instead,
torch's offset-based semantics: a seed every rank agrees on and an offset every rank advances
alike (by the global element count of each draw).  Each rank draws the values of the *global*
tensor at that offset and keeps the slice its placements select, so replicated results are
identical on every rank and sharded results are the matching slice of the single-device draw.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from hp_dtensor.layout.shard_geometry import local_shape_and_offset
from hp_dtensor.placement_types import Placement

_state: dict[str, Any] = {"seed": None, "offset": 0}


def manual_seed(seed: int) -> None:
    """Set the job-wide DTensor random stream (call with the same seed on every rank)."""
    _state.update(seed=int(seed) & 0xFFFF_FFFF_FFFF_FFFF, offset=0)


def _agreed_seed(mesh: Any) -> int:
    """The stream's seed; at first use rank 0 of the world picks one and every rank learns it
    (so call random ops on every rank, as any collective)."""
    if _state["seed"] is None:
        import os

        from hp_dtensor.platform.mindspore import collectives as C
        from hp_dtensor.platform.mindspore import process_group as PG

        mine = int(np.frombuffer(os.urandom(8), np.int64)[0])
        n = PG.get_world_size()
        if n > 1:
            # The stream is job-wide (not per mesh), so world rank 0's pick is everyone's seed.
            mine = C.COLLECTIVES.gather_int_rows([[mine]], PG.world_group(), n, PG.get_rank())[0][0]
        _state["seed"] = int(mine) & 0xFFFF_FFFF_FFFF_FFFF
    return int(_state["seed"])


class Draw(enum.Enum):
    """The distributions the job-wide stream draws (float32 on every rank, cast by the caller)."""

    UNIFORM = "uniform"  # [0, 1)
    NORMAL = "normal"  # mean 0, std 1


def draw_local(mesh: Any, global_shape: tuple[int, ...], placements: tuple[Placement, ...],
               kind: Draw = Draw.UNIFORM) -> np.ndarray:
    """This rank's slice of the next draw of ``global_shape`` from the job-wide stream.

    Every rank draws the global tensor at the same offset and keeps the ``torch.chunk``-style
    block its ``Shard`` placements select (uneven shards included), so the slices of all ranks tile
    the one draw; ``Replicate`` and ``Partial`` mesh dims keep the whole extent (what a ``Partial``
    term means is the caller's decision).  The offset advances by the global element count, which
    is more counter steps than either distribution consumes, so consecutive draws never overlap."""
    seed = _agreed_seed(mesh)
    offset = int(_state["offset"])
    numel = int(np.prod(global_shape, dtype=np.int64))
    _state["offset"] = offset + numel
    gen = np.random.Generator(np.random.Philox(key=seed, counter=offset))
    if kind is Draw.UNIFORM:
        full = gen.random(global_shape, dtype=np.float32)
    else:
        full = gen.standard_normal(global_shape, dtype=np.float32)
    coord = mesh.get_coordinate()
    shape, start = local_shape_and_offset(global_shape, mesh.shape, placements, coord)
    index = tuple(slice(o, o + n) for o, n in zip(start, shape))
    return np.require(full[index], requirements="C")


def uniform_local(mesh: Any, global_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> np.ndarray:
    """Uniform [0, 1) float32 values of the next draw of ``global_shape``, this rank's slice."""
    return draw_local(mesh, global_shape, placements, Draw.UNIFORM)


class _MindSporeRNG:
    """MindSpore's ``RNGPrimitives`` (see ``hp_dtensor.api.rng_tracker``): the seed is the job-wide
    stream's above, exchanged over mccl, so ``hp_dtensor.manual_seed(seed, mesh)`` seeds it and
    checks that every rank passed the same seed."""

    @staticmethod
    def set_seed(seed: int) -> None:
        manual_seed(seed)

    @staticmethod
    def broadcast_rng_state(mesh: Any) -> bool:
        # The stream's seed is agreed at first use (rank 0 picks it); a rank's own generator
        # state never enters a DTensor draw, so nothing on this rank changes.
        _agreed_seed(mesh)
        return False


RNG = _MindSporeRNG()
