"""``DTensor`` for MindSpore: a ``Tensor`` subclass whose data is this rank's shard.

The object *is* the local tensor (``Tensor._make_subclass``), so MindSpore's autograd sees the
local computation directly; ``shape`` reports the global shape.  Every MindSpore op on it reaches
``__fallback__`` (see ``dispatch.py``), which redistributes inputs as the sharding rule asks and
runs the op on local data.  ``Parameter(DTensor)`` keeps the subclass, so a sharded module
parameter is a DTensor with placements and its gradient is the local one (see the gradient
convention in ``redistribute.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor_spec import (
    DTensorSpec,
    distribute_placements,
    from_local_spec,
    redistribute_target,
    resolve_mesh,
)
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.redistribute import GradLayout, KeepGradOnRoot, Redistribute
from hp_dtensor.shard_geometry import check_equal_shard_shapes


class DTensor(Tensor):  # type: ignore[misc]
    """A tensor laid out over a ``DeviceMesh`` by one placement per mesh dim."""

    _spec: DTensorSpec
    # Set on values made by ``redistribute``: how their gradient is collected (see GradLayout).
    _grad_layout: GradLayout | None = None

    def __new__(cls, local_tensor: Any, spec: DTensorSpec | None = None) -> DTensor:
        if spec is None:
            if not isinstance(local_tensor, DTensor):
                raise TypeError("DTensor(local, spec) needs a spec; use DTensor.from_local or distribute_tensor")
            spec = local_tensor._spec  # Parameter(DTensor) re-creates the object from a DTensor
        t = Tensor._make_subclass(cls, local_tensor)
        t._spec = spec
        return t  # type: ignore[no-any-return]

    @classmethod
    def __fallback__(cls, func: Any, args: Any = (), kwargs: Any = None) -> Any:
        from hp_dtensor.platform.mindspore.dispatch import dispatch

        return dispatch(func, tuple(args), dict(kwargs or {}))

    # ----- what the global tensor looks like -----
    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def __repr__(self) -> str:
        return (f"DTensor(local_tensor={self.to_local()}, device_mesh={self._spec.mesh}, "
                f"placements={self._spec.placements})")

    __str__ = __repr__

    def __getitem__(self, index: Any) -> Any:
        raise NotImplementedError(
            "indexing a MindSpore DTensor is not supported (it would read the local shard); "
            "index .to_local() or .full_tensor() instead"
        )

    def __setitem__(self, index: Any, value: Any) -> None:
        raise NotImplementedError(
            "item assignment on a MindSpore DTensor is not supported; assign into .to_local() instead"
        )

    def asnumpy(self) -> np.ndarray:
        raise RuntimeError(
            "asnumpy() on a DTensor is ambiguous (local shard or whole tensor); call "
            ".to_local().asnumpy() or .full_tensor().asnumpy()"
        )

    # ----- public API -----
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> Tensor:
        """This rank's shard as a plain Tensor sharing data and autograd history."""
        if grad_placements is not None:
            raise NotImplementedError(
                "to_local(grad_placements=...) is not supported on MindSpore: the local gradient's layout "
                "follows the tensor's placements"
            )
        # The caller's gradient for a plain tensor is whole on every rank.
        return self._whole_grad_use(Tensor._make_subclass(Tensor, self))

    def _whole_grad_use(self, local: Any) -> Any:
        """``local`` (this value, as some consumer will use it) adapted to a consumer whose
        backward hands back a whole gradient (see ``GradLayout``)."""
        layout = self._grad_layout
        if layout is None:
            return local
        if layout.partial is None:
            layout.partial = ()
        elif layout.partial:
            return KeepGradOnRoot.apply(local, self._spec.mesh, layout.partial)
        return local

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | Placement | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """Change placements on the same mesh with the cheapest collective plan (differentiable)."""
        if isinstance(device_mesh, (Placement, list, tuple)) and placements is None:
            device_mesh, placements = None, device_mesh  # redistribute(placements) positional form
        spec = self._spec
        dst = redistribute_target(spec, device_mesh, placements)
        if dst == spec.placements:
            return self
        layout = GradLayout()
        out = DTensor(Redistribute.apply(self._whole_grad_use(self), spec.mesh, spec.shape, spec.placements, dst, layout),
                      DTensorSpec(spec.mesh, dst, spec.shape))
        out._grad_layout = layout
        return out

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> Tensor:
        """The whole tensor on every rank (differentiable)."""
        rep = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return rep.to_local(grad_placements=grad_placements)

    @staticmethod
    def from_local(
        local_tensor: Any,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | Placement | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """Wrap each rank's ``local_tensor`` as the shard of a DTensor (differentiable, no copy).

        ``run_check=True`` checks with one all_gather of shapes that every rank's shard has the
        same shape (even sharding), and raises ``ValueError`` naming the ranks that differ."""
        mesh = resolve_mesh(device_mesh, "from_local")
        if isinstance(local_tensor, DTensor):
            raise ValueError("from_local got a DTensor; pass its .to_local() or use .redistribute()")
        if not isinstance(local_tensor, Tensor):
            raise TypeError(f"from_local expects a mindspore.Tensor, got {type(local_tensor).__name__}")
        lshape = tuple(Tensor.shape.fget(local_tensor))
        spec = from_local_spec(lshape, mesh, placements, shape)
        if run_check:
            _check_equal_local_shapes(lshape, mesh)
        return DTensor(local_tensor, spec)


def _check_equal_local_shapes(lshape: tuple[int, ...], mesh: DeviceMesh) -> None:
    # As on torch: gather every rank's shape over all mesh dims, then every rank decides alike.
    coord = mesh.get_coordinate()
    assert coord is not None
    rows = Tensor(np.array([list(lshape) + [len(lshape)]], np.float32))
    with NoFallbackGuard():
        for k in reversed(range(mesh.ndim)):
            gathered = C.all_gather(rows.reshape((1,) + tuple(rows.shape)), 0, mesh.get_group(k), mesh.shape[k], coord[k])
            rows = gathered.reshape((-1, rows.shape[-1]))
        table = rows.asnumpy().astype(int).tolist()
    check_equal_shard_shapes(table, mesh)


def distribute_tensor(
    tensor: Any,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | Placement | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay ``tensor`` (the whole tensor, as seen by this rank) out on the mesh.

    ``src_data_rank=0``: group-rank 0 of each mesh dim is the source and its values are broadcast
    (MindSpore's CPU backend has no scatter), so other ranks may pass anything of the right shape;
    ``None``: every rank slices its own copy, no collective.  A tensor whose data is not
    materialized yet (``has_init``, MindSpore's lazy initializer, the analogue of torch's meta
    tensors) never communicates: each rank materializes it itself, so seed the ranks alike."""
    mesh = resolve_mesh(device_mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        raise ValueError("distribute_tensor got a DTensor; use .redistribute() to change its placements")
    if not isinstance(tensor, Tensor):
        raise TypeError(f"distribute_tensor expects a mindspore.Tensor, got {type(tensor).__name__}")
    gshape = tuple(Tensor.shape.fget(tensor))
    pl = distribute_placements(gshape, mesh, placements)
    if getattr(tensor, "has_init", False):
        tensor = tensor.init_data()
        src_data_rank = None
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not part of {mesh}")
    with NoFallbackGuard():
        local = C._plain(tensor)
        for k, p in enumerate(pl):
            n = mesh.shape[k]
            if src_data_rank is not None and n > 1:
                src_global = mesh.group_ranks(k)[src_data_rank]
                local = C.broadcast(local, src_data_rank, mesh.get_group(k), n, coord[k], src_global)
            if isinstance(p, Shard):
                local = C._chunk(local, p.dim, n, coord[k])
            elif isinstance(p, Partial) and p.reduce_op == "sum" and coord[k] != 0:
                local = ops.zeros_like(local)
        local = ops.deepcopy(local)
    return DTensor(local, DTensorSpec(mesh, pl, gshape))


def as_parameter(dt: DTensor, old: Any) -> Any:
    """A ``Parameter`` holding ``dt`` (still a DTensor), with ``old``'s name and requires_grad."""
    name = getattr(old, "name", None)
    requires_grad = bool(getattr(old, "requires_grad", True))
    return ms.Parameter(dt, name=name, requires_grad=requires_grad)


__all__ = ["DTensor", "DTensorSpec", "distribute_tensor"]
