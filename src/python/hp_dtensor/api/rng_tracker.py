"""Random ops on DTensors draw what one process would draw.

A random op on a DTensor (``dropout``, ``rand_like``, ``normal_``, ``uniform_``, the
``nn.init`` functions, ...) draws the *global* tensor from the framework's default generator and
keeps this rank's shard of it.  Every rank runs the same draws in the same order, so generator
states stay equal across the mesh: a replicated result is identical on every rank, and a sharded
result is exactly the matching slice of what one process draws after the same ``manual_seed``.
The price is that each rank draws the global number of elements: small next to the layer the
draw feeds, and exact on every generator (a counter-based offset, as torch uses on CUDA, does not
exist for the CPU's Mersenne twister).

Generator states must agree across the mesh before the first draw.  ``manual_seed(seed, mesh)``
seeds every rank and checks that all ranks passed the same seed; otherwise the first random op
on a mesh copies the generator state of the mesh's first rank to the others (one broadcast per
mesh dim, once per mesh) and warns on every rank whose state differed, as torch does.
"""

from __future__ import annotations

import warnings
from typing import Protocol

from hp_dtensor.api.mesh_exchange import gather_over_mesh
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.platform import backend_primitives, current


class RNGPrimitives(Protocol):
    """What a backend supplies: its default generator and the broadcast of its state."""

    def set_seed(self, seed: int) -> None: ...

    def broadcast_rng_state(self, mesh: DeviceMesh) -> bool:
        """Copy the generator state of the mesh's first rank to every rank of ``mesh``;
        True on a rank whose state changed."""
        ...


# Rank tuples of the meshes whose generator states are known to agree.
_synced: set[tuple[int, ...]] = set()


def _primitives() -> RNGPrimitives:
    prims: RNGPrimitives = backend_primitives(
        "RNG", "random ops on DTensors",
        "draw a plain tensor with the same seed on every rank and use DTensor.from_local",
    )
    return prims


def _gather_seed(value: int, mesh: DeviceMesh) -> list[int]:
    """``value`` of every rank of ``mesh``, in the mesh's row-major rank order.  Seeds range over
    [-2**63, 2**64), wider than the int64 rows the collectives move: exchanged as two halves,
    the high one signed."""
    rows = gather_over_mesh([[value >> 32, value & 0xFFFFFFFF]], mesh, current().COLLECTIVES)
    return [(int(hi) << 32) | int(lo) for hi, lo in rows]


def _ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(mesh.layout.ranks)


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed the default generator of every rank of ``device_mesh`` with ``seed``.

    Collective over the mesh: every rank must call it.  Raises ``ValueError`` on every rank
    when the ranks passed different seeds (naming each rank's seed), ``RuntimeError`` when this
    rank is not part of the mesh."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"manual_seed: seed {seed} is out of range [-2**63, 2**64)")
    if device_mesh.get_coordinate() is None:
        raise RuntimeError(
            f"manual_seed: rank {device_mesh.get_rank()} is not part of {device_mesh}; call it on "
            f"a mesh that contains every calling rank"
        )
    prims = _primitives()
    seeds = _gather_seed(seed, device_mesh)
    if any(s != seeds[0] for s in seeds):
        detail = ", ".join(f"rank {r}: {s}" for r, s in zip(_ranks(device_mesh), seeds))
        raise ValueError(
            f"manual_seed: the ranks of {device_mesh} passed different seeds ({detail}); "
            f"random DTensor ops need one seed on every rank of the mesh"
        )
    prims.set_seed(seed)
    _synced.add(_ranks(device_mesh))


def ensure_synced(mesh: DeviceMesh) -> None:
    """Called by a backend before a random draw on ``mesh``: the first time, make the generator
    states of its ranks agree (see the module docstring)."""
    ranks = _ranks(mesh)
    if ranks in _synced:
        return
    changed = _primitives().broadcast_rng_state(mesh)
    _synced.add(ranks)
    if changed:
        warnings.warn(
            f"DTensor random ops: rank {mesh.get_rank()}'s generator state differed from that of "
            f"rank {ranks[0]}, the first rank of {mesh}, and was set to it so that random DTensors "
            f"agree across the mesh; seed every rank alike (torch.manual_seed(seed) on each rank, "
            f"or hp_dtensor.manual_seed(seed, mesh)) to silence this",
            stacklevel=3,
        )


def forget_synced() -> None:
    """Drop what is known about synchronised meshes (after a rank reseeds its generator on its
    own, so that the next random DTensor op checks again)."""
    _synced.clear()


__all__ = ["RNGPrimitives", "ensure_synced", "forget_synced", "manual_seed"]
