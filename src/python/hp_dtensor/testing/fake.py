"""Single-process meshes over the ``fake`` process group (no data moves)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hp_dtensor.platform import current as _platform


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Pretend to be ``rank`` of ``world_size`` ranks: meshes and groups are created, collectives
    return without communicating.  For geometry (shapes, placements, plans), not values."""
    plat = _platform()
    if plat.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group")
    plat.init_fake(rank, world_size)
    try:
        yield
    finally:
        plat.destroy()
