"""``DeviceMesh``: an N-D grid of ranks with one process group per mesh dim.

Topology comes from the pure ``MeshLayout``; process groups come from the platform, created
collectively at construction (every rank creates every group, in the same order) and cached by
their rank tuple, so slicing (``mesh["tp"]``) never issues a collective.  ``with mesh:`` makes a
mesh current for code that takes ``device_mesh=None``.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from hp_dtensor.layout.mesh_layout import MeshLayout
from hp_dtensor.platform import current as _platform

_ctx = threading.local()


class DeviceMesh:
    """A mesh of ranks.  ``mesh_shape``/``mesh`` as in ``torch.distributed.device_mesh``."""

    def __init__(
        self,
        device_type: str,
        mesh: Sequence[Any] | Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _layout: MeshLayout | None = None,
        _init_groups: bool = True,
    ) -> None:
        plat = _platform()
        if _layout is None:
            # A mesh the caller builds gets the same device check and start-up as init_device_mesh
            # (a sliced or internal mesh inherits a device_type that already passed them).
            device_type = check_device_type(device_type)
            plat.ensure_process_group(device_type)
        self.device_type = device_type
        if _layout is None:
            shape, ranks = _shape_and_ranks(mesh)
            _layout = MeshLayout(shape, ranks, tuple(mesh_dim_names) if mesh_dim_names else None)
            world = plat.get_world_size() if plat.is_initialized() else None
            outside = [r for r in ranks if r < 0 or (world is not None and r >= world)]
            if outside:
                raise ValueError(
                    f"mesh ranks {outside} are not ranks of the world (size {world}); "
                    f"a mesh may only hold ranks 0..{(world or 1) - 1}"
                )
        self._layout = _layout
        # The mesh this one was sliced from (itself for a mesh built directly): meshes sliced from
        # one root can be combined, e.g. a parameter's TP dim with the data-parallel dims.
        self._root_mesh: DeviceMesh = self
        self._rank = plat.get_rank()
        self._coord = _layout.coordinate_of(self._rank)
        # the default group this mesh's groups belong to (a slice takes its root's)
        self._world = plat.world_generation()
        if _init_groups:
            for dim in range(_layout.ndim):
                for ranks in _layout.groups_along(dim):
                    plat.get_or_create_group(ranks)

    # ----- topology -----
    @property
    def ndim(self) -> int:
        return self._layout.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._layout.dim_names

    @property
    def layout(self) -> MeshLayout:
        return self._layout

    def size(self, mesh_dim: int | None = None) -> int:
        return self._layout.size if mesh_dim is None else self._layout.shape[mesh_dim]

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or None when it is not part of it."""
        return self._coord

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("get_local_rank() needs a mesh_dim on a mesh with more than one dim")
            mesh_dim = 0
        k = self._layout.dim_index(mesh_dim)
        if self._coord is None:
            raise RuntimeError(f"rank {self._rank} is not part of mesh {self._layout.ranks}")
        return self._coord[k]

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The process group of this rank along ``mesh_dim``."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("get_group() needs a mesh_dim on a mesh with more than one dim")
            mesh_dim = 0
        k = self._layout.dim_index(mesh_dim)
        plat = _platform()
        if plat.world_generation() != self._world:
            # its groups went with the default group they were made in; making one now would be
            # a collective that only this dim's ranks enter
            raise RuntimeError(
                f"mesh {self._layout.ranks} was built under a default process group that has since been "
                f"destroyed; build the mesh again (init_device_mesh) after starting the new one"
            )
        return plat.get_or_create_group(self._layout.group_of(self._rank, k))

    def group_ranks(self, mesh_dim: int) -> tuple[int, ...]:
        return self._layout.group_of(self._rank, mesh_dim)

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str):
            names = (names,)
        if self.mesh_dim_names is None:
            raise KeyError("this mesh has no mesh_dim_names; create it with mesh_dim_names=(...) to slice it")
        dims = [self._layout.dim_index(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"mesh[{', '.join(map(repr, names))}] names a mesh dim twice; name each dim once")
        if dims == list(range(self.ndim)):
            return self
        sub = self._layout.submesh(dims, self._rank)
        out = DeviceMesh(self.device_type, None, _layout=sub, _init_groups=False)
        out._root_mesh = self._root_mesh
        out._world = self._world
        return out

    def get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced from with ``mesh[...]`` (itself when it was not sliced)."""
        return self._root_mesh

    # ----- identity -----
    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._layout == other._layout)

    def __hash__(self) -> int:
        return self._hash

    @property
    def _hash(self) -> int:
        h = self.__dict__.get("_hash_cache")
        if h is None:
            h = self.__dict__["_hash_cache"] = hash(self._layout)
        return h

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', shape={self.shape}, ranks={list(self._layout.ranks)}{names})"

    # ----- current mesh -----
    def __enter__(self) -> DeviceMesh:
        _stack().append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _stack().pop()


def _stack() -> list[DeviceMesh]:
    if not hasattr(_ctx, "stack"):
        _ctx.stack = []
    return _ctx.stack  # type: ignore[no-any-return]


def get_current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def _shape_and_ranks(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Accept a nested list / array-like of ranks; ragged nesting raises ``ValueError``."""
    if hasattr(mesh, "tolist"):
        mesh = mesh.tolist()
    if not isinstance(mesh, (list, tuple)):
        raise ValueError(f"mesh must be a nested list of ranks, got {mesh!r}")
    shape: list[int] = []
    level: Any = mesh
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        level = level[0] if level else None
    flat: list[int] = []

    def walk(x: Any, depth: int) -> None:
        if isinstance(x, (list, tuple)):
            if depth >= len(shape) or len(x) != shape[depth]:
                raise ValueError(
                    f"mesh {mesh!r} is ragged: every row at depth {depth} must have {shape[min(depth, len(shape) - 1)]} "
                    f"entries, found one with {len(x)}"
                )
            for y in x:
                walk(y, depth + 1)
        else:
            if depth != len(shape):
                raise ValueError(f"mesh {mesh!r} is ragged: rank {x!r} sits at depth {depth}, expected {len(shape)}")
            try:
                if isinstance(x, bool):
                    raise TypeError
                flat.append(operator.index(x))
            except TypeError:
                raise ValueError(f"mesh entries must be int ranks, got {x!r}") from None

    walk(mesh, 0)
    return tuple(shape), tuple(flat)


# Names users write for a device kind that meshes spell otherwise (torch's spelling).
_SPELLED_OTHERWISE = {"gpu": "cuda", "ascend": "npu"}


def check_device_type(device_type: object) -> str:
    """The rule for a mesh's ``device_type``, applied by ``DeviceMesh`` and ``init_device_mesh``
    alike: a device kind, spelled as torch spells it and without an index, that the backend runs
    collectives on (torch: "cpu" gloo, "cuda" nccl, "npu" hccl through torch_npu; MindSpore: "cpu"
    mccl, "npu" hccl).  Returns it; ``TypeError`` for a non-string, ``ValueError`` naming the value
    and the accepted kinds otherwise.  Whether the device is present is the backend's check, made
    when the process group starts."""
    plat = _platform()
    accepted = sorted(plat.DEVICE_TYPES)
    if not isinstance(device_type, str):
        kind = getattr(device_type, "type", None)
        hint = f"; pass its kind, device_type={kind!r}" if isinstance(kind, str) else ""
        raise TypeError(
            f"device_type must be a str, one of {accepted}, got {type(device_type).__name__} {device_type!r}{hint}"
        )
    if device_type in plat.DEVICE_TYPES:
        return device_type
    kind = device_type.split(":", 1)[0].strip().lower()
    kind = _SPELLED_OTHERWISE.get(kind, kind)
    if ":" in device_type and kind in plat.DEVICE_TYPES:
        hint = (f"; a mesh names the device kind, not one device (each rank uses its own local device): "
                f"pass {kind!r}")
    elif kind in plat.DEVICE_TYPES:
        hint = f"; did you mean {kind!r}?"
    elif kind == "meta":
        hint = ("; a mesh needs devices that run collectives: build the model on the meta device and the mesh "
                "on the device it will run on")
    else:
        hint = ""
    raise ValueError(f"device_type {device_type!r} is not one of {accepted} on {plat.NAME}{hint}")


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """Create a mesh over ranks ``0..prod(mesh_shape)-1`` (row-major).

    Starts the default process group from the launcher's environment (torchrun) when none exists.
    ``device_type``: see ``check_device_type`` (torch: "cpu" gloo, "cuda" nccl, "npu" hccl
    through torch_npu; MindSpore: "cpu", "npu").
    """
    device_type = check_device_type(device_type)
    shape = tuple(int(s) for s in mesh_shape)
    plat = _platform()
    plat.ensure_process_group(device_type)
    world = plat.get_world_size()
    layout = MeshLayout.contiguous(shape, mesh_dim_names)
    if layout.size != world:
        raise ValueError(
            f"mesh_shape {shape} needs {layout.size} ranks but the world has {world}; "
            f"make the product of mesh_shape equal the number of launched ranks"
        )
    return DeviceMesh(device_type, None, _layout=layout)
