"""Pure mesh topology: which global ranks form the group of each mesh dim.

A mesh of shape ``(d0, d1, ...)`` over ranks ``mesh[i0, i1, ...]`` (row-major by default).
The group of mesh dim ``k`` seen from a rank is the ranks that share all its coordinates except
coordinate ``k``.  No framework import: used by ``DeviceMesh`` and by geometry tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MeshLayout:
    """Shape and rank grid of a device mesh (``ranks`` is the flattened row-major grid)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.shape or any((not isinstance(s, int)) or s < 1 for s in self.shape):
            raise ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {self.shape}")
        if math.prod(self.shape) != len(self.ranks):
            raise ValueError(
                f"mesh shape {self.shape} holds {math.prod(self.shape)} ranks but {len(self.ranks)} were given"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"mesh ranks must be distinct, got {self.ranks}")
        if self.dim_names is not None:
            if len(self.dim_names) != len(self.shape):
                raise ValueError(
                    f"mesh_dim_names {self.dim_names} has {len(self.dim_names)} names for a "
                    f"{len(self.shape)}-D mesh"
                )
            if len(set(self.dim_names)) != len(self.dim_names):
                raise ValueError(f"mesh_dim_names must be unique, got {self.dim_names}")

    @classmethod
    def contiguous(cls, shape: Sequence[int], dim_names: Sequence[str] | None = None) -> MeshLayout:
        shape_t = tuple(int(s) for s in shape)
        return cls(shape_t, tuple(range(math.prod(shape_t))), tuple(dim_names) if dim_names else None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _strides(self) -> tuple[int, ...]:
        strides = [1] * self.ndim
        for k in range(self.ndim - 2, -1, -1):
            strides[k] = strides[k + 1] * self.shape[k + 1]
        return tuple(strides)

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """Mesh coordinate of a global rank, or None when the rank is not in the mesh."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            return None
        return tuple((flat // s) % n for s, n in zip(self._strides(), self.shape))

    def rank_at(self, coord: Sequence[int]) -> int:
        return self.ranks[sum(c * s for c, s in zip(coord, self._strides()))]

    def dim_index(self, name_or_dim: str | int) -> int:
        if isinstance(name_or_dim, int):
            if not -self.ndim <= name_or_dim < self.ndim:
                raise IndexError(f"mesh dim {name_or_dim} is out of range for a {self.ndim}-D mesh")
            return name_or_dim % self.ndim
        if self.dim_names is None or name_or_dim not in self.dim_names:
            raise KeyError(
                f"mesh has no dim named {name_or_dim!r}; its dims are {self.dim_names}"
            )
        return self.dim_names.index(name_or_dim)

    def groups_along(self, dim: int) -> list[tuple[int, ...]]:
        """All rank groups of mesh dim ``dim``, each ordered by the coordinate along ``dim``."""
        other = [range(n) if k != dim else range(1) for k, n in enumerate(self.shape)]
        groups = []
        for base in itertools.product(*other):
            coord = list(base)
            group = []
            for i in range(self.shape[dim]):
                coord[dim] = i
                group.append(self.rank_at(coord))
            groups.append(tuple(group))
        return groups

    def group_of(self, rank: int, dim: int) -> tuple[int, ...]:
        coord = self.coordinate_of(rank)
        if coord is None:
            raise ValueError(f"rank {rank} is not in mesh {self.ranks}")
        c = list(coord)
        out = []
        for i in range(self.shape[dim]):
            c[dim] = i
            out.append(self.rank_at(c))
        return tuple(out)

    def submesh(self, dims: Sequence[int], rank: int) -> MeshLayout:
        """The sub-mesh over ``dims`` that contains ``rank`` (other coordinates fixed to rank's)."""
        coord = self.coordinate_of(rank)
        if coord is None:
            raise ValueError(f"rank {rank} is not in mesh {self.ranks}")
        sub_shape = tuple(self.shape[d] for d in dims)
        ranks = []
        for sub in itertools.product(*(range(n) for n in sub_shape)):
            c = list(coord)
            for d, i in zip(dims, sub):
                c[d] = i
            ranks.append(self.rank_at(c))
        names = tuple(self.dim_names[d] for d in dims) if self.dim_names else None
        return MeshLayout(sub_shape, tuple(ranks), names)
