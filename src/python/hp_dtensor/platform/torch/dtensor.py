"""``DTensor`` for torch: a wrapper tensor subclass holding this rank's shard.

The wrapper has the global shape and dtype; ``_local_tensor`` holds the local shard.  Every aten op
on it goes through ``__torch_dispatch__`` (see ``dispatch.py``), below autograd, so backward ops
are dispatched the same way and parameter gradients come out as DTensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor_spec import (
    DTensorSpec,
    distribute_placements,
    from_local_spec,
    redistribute_target,
    resolve_mesh,
)
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard, normalize_placements
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.redistribute import FromLocal, Redistribute, ToLocal
from hp_dtensor.shard_geometry import check_equal_shard_shapes
from hp_dtensor.sharding.strides import global_strides


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


class DTensor(torch.Tensor):
    """A tensor laid out over a ``DeviceMesh`` by one placement per mesh dim."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=global_strides(local_tensor.stride(), spec.mesh.shape, spec.placements),
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        from hp_dtensor.platform.torch.dispatch import dispatch

        return dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    # ----- public API -----
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard; differentiable (the gradient comes back with ``grad_placements``,
        default this tensor's placements)."""
        gp = None
        if grad_placements is not None:
            gp = normalize_placements(tuple(grad_placements), self._spec.mesh.ndim, self.ndim)
        if not torch.is_grad_enabled():
            return self._local_tensor
        return ToLocal.apply(self, gp)  # type: ignore[no-any-return]

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
        dst = redistribute_target(self._spec, device_mesh, placements)
        if dst == self._spec.placements:
            return self
        mesh = self._spec.mesh
        return Redistribute.apply(self, mesh, dst)  # type: ignore[no-any-return]

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole tensor on every rank (differentiable)."""
        rep = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return rep.to_local(grad_placements=grad_placements)

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
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
        spec = from_local_spec(local_tensor.shape, mesh, placements, shape)
        if run_check:
            _check_equal_local_shapes(local_tensor, mesh)
        return FromLocal.apply(local_tensor, spec)  # type: ignore[no-any-return]


def _check_equal_local_shapes(local: torch.Tensor, mesh: DeviceMesh) -> None:
    # Gather every rank's shape over all mesh dims (last dim first, so rows come out in the mesh's
    # row-major rank order) before deciding: every rank then raises together, none is left
    # waiting in a collective its peers skipped.
    coord = mesh.get_coordinate()
    assert coord is not None
    rows = torch.tensor([list(local.shape) + [local.ndim]], dtype=torch.int64)
    for k in reversed(range(mesh.ndim)):
        rows = C.all_gather(rows.unsqueeze(0), 0, mesh.get_group(k), mesh.shape[k]).flatten(0, 1)
    check_equal_shard_shapes(rows.tolist(), mesh)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | Placement | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay ``tensor`` (the whole tensor, as seen by this rank) out on the mesh.

    ``src_data_rank=0``: group-rank 0 of each mesh dim is the source; its values are scattered or
    broadcast, so other ranks may pass anything of the right shape.  ``None``: every rank slices
    its own copy, no collective.  A meta tensor never communicates."""
    mesh = resolve_mesh(device_mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        raise ValueError("distribute_tensor got a DTensor; use .redistribute() to change its placements")
    gshape = tuple(tensor.shape)
    pl = distribute_placements(gshape, mesh, placements)
    requires_grad = tensor.requires_grad
    src = None if tensor.is_meta else src_data_rank
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not part of {mesh}")
    with torch.no_grad():
        local = tensor.detach()
        for k, p in enumerate(pl):
            n = mesh.shape[k]
            if isinstance(p, Shard):
                size = local.shape[p.dim] // n
                if src is None:
                    local = local.narrow(p.dim, coord[k] * size, size)
                else:
                    group_ranks = mesh.group_ranks(k)
                    chunks = list(local.contiguous().chunk(n, dim=p.dim))
                    is_src = coord[k] == src
                    local = C.scatter(chunks if is_src else None, chunks[0], group_ranks[src], mesh.get_group(k))
            else:
                if src is not None:
                    local = C.broadcast(local, mesh.group_ranks(k)[src], mesh.get_group(k))
                if isinstance(p, Partial) and p.reduce_op == "sum" and coord[k] != 0:
                    local = torch.zeros_like(local)
        local = local.contiguous()
        if local.data_ptr() == tensor.data_ptr() and not tensor.is_meta:
            local = local.clone()
    out = DTensor(local, DTensorSpec(mesh, pl, gshape), requires_grad=requires_grad)
    return out


__all__ = ["DTensor", "DTensorSpec", "distribute_tensor"]
