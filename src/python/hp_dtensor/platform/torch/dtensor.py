"""``DTensor`` for torch: a wrapper tensor subclass holding this rank's shard.

The wrapper has the global shape and dtype; ``_local_tensor`` holds the local shard.  Every aten op
on it goes through ``__torch_dispatch__`` (see ``dispatch.py``), below autograd, so backward ops
are dispatched the same way and parameter gradients come out as DTensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor import from_local_check
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor_spec import (
    DTensorSpec,
    check_partial_dtype,
    check_src_data_rank,
    distribute_placements,
    from_local_spec,
    redistribute_target,
    resolve_mesh,
)
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard, normalize_placements
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.redistribute import FromLocal, Redistribute, ToLocal
from hp_dtensor.shard_geometry import chunk_size, chunk_size_and_offset
from hp_dtensor.sharding.strides import global_strides


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


# The op dispatcher, imported on first use (it imports this module); kept in a global so that the
# per-op path pays no import statement.
_dispatch: Any = None


def _load_dispatch() -> Any:
    global _dispatch
    from hp_dtensor.platform.torch.dispatch import dispatch

    _dispatch = dispatch
    return dispatch


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

    # A traceable wrapper subclass: besides tracing, this makes ``nn.Module._apply`` (``to``,
    # ``double()``, ``to_empty``) swap whole parameter objects instead of assigning ``.data``, which
    # would change the wrapper's dtype or device and leave ``_local_tensor`` as it was.
    def __tensor_flatten__(self) -> tuple[list[str], tuple[DTensorSpec, bool]]:
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: tuple[DTensorSpec, bool], outer_size: Any, outer_stride: Any
    ) -> DTensor:
        spec, requires_grad = meta
        return DTensor(inner["_local_tensor"], spec, requires_grad=requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return (_dispatch or _load_dispatch())(func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    # ----- torch.distributed.checkpoint extension hooks (see dcp.py) -----
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from hp_dtensor.platform.torch import dcp

        return dcp.create_write_items(self._local_tensor, self._spec, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        from hp_dtensor.platform.torch import dcp

        return dcp.create_chunk_list(self._spec)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        from hp_dtensor.platform.torch import dcp

        return dcp.get_tensor_shard(self._local_tensor, self._spec, index)

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
        dst = redistribute_target(self._spec, device_mesh, placements, uneven=True)
        check_partial_dtype(dst, str(self.dtype), _is_floating(self.dtype))
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

        Without ``shape`` the global shape assumes even sharding (every rank's shard alike), as in
        torch; uneven shards need ``shape`` (and optionally ``stride``, the global contiguous
        strides).  ``run_check=True`` exchanges one fixed-size record per rank (ndim, shape, dtype,
        placements, ``shape``, a checksum of the data) and raises the same ``ValueError`` on every
        rank, naming each rank's value, when they do not describe one DTensor -- including
        ``Replicate`` shards whose data differ."""
        mesh = resolve_mesh(device_mesh, "from_local")
        if not run_check:
            spec = _from_local_spec(local_tensor, mesh, placements, shape, stride)
            return FromLocal.apply(local_tensor, spec)  # type: ignore[no-any-return]
        error: Exception | None = None
        try:
            spec = _from_local_spec(local_tensor, mesh, placements, shape, stride)
        except (ValueError, TypeError) as e:
            error = e
        _run_check(local_tensor, mesh, placements, shape, error is None)
        if error is not None:
            raise error
        return FromLocal.apply(local_tensor, spec)  # type: ignore[no-any-return]


def _is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _from_local_spec(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement] | Placement | None,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
) -> DTensorSpec:
    spec = from_local_spec(local.shape, mesh, placements, shape, uneven=True)
    check_partial_dtype(spec.placements, str(local.dtype), _is_floating(local.dtype))
    if stride is not None and tuple(int(s) for s in stride) != _contiguous_strides(spec.shape):
        raise ValueError(
            f"stride={tuple(stride)} is not the contiguous stride {_contiguous_strides(spec.shape)} of "
            f"shape {spec.shape}: DTensors describe their global tensor as contiguous"
        )
    return spec


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two float64 sums of the data (plain and position-weighted), as their bit patterns: equal
    data give equal bits, and a differing element almost surely changes one of them."""
    if t.is_meta or t.numel() == 0:
        return (0, 0)
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1).to(torch.float64)
    w = torch.arange(x.numel(), dtype=torch.float64, device=x.device).remainder_(1021).add_(1)
    sums = torch.stack([x.sum(), (x * w).sum()]).cpu()
    a, b = sums.view(torch.int64).tolist()
    return (int(a), int(b))


def _run_check(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement] | Placement | None,
    shape: Sequence[int] | None,
    ok: bool,
) -> None:
    coord = mesh.get_coordinate()
    if coord is None:
        return
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    rec = from_local_check.make_record(
        ok, tuple(local.shape), str(local.dtype), placements, shape, _checksum(local)
    )
    # Gather every rank's record over all mesh dims (last dim first, so rows come out in the mesh's
    # row-major rank order); every rank then decides on the same table.
    rows = torch.tensor([rec.encode()], dtype=torch.int64, device=local.device if not local.is_meta else "cpu")
    for k in reversed(range(mesh.ndim)):
        rows = C.all_gather(rows.unsqueeze(0), 0, mesh.get_group(k), mesh.shape[k]).flatten(0, 1)
    from_local_check.verify(rows.cpu().tolist(), mesh.layout)


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
    pl = distribute_placements(gshape, mesh, placements, uneven=True)
    check_partial_dtype(pl, str(tensor.dtype), _is_floating(tensor.dtype))
    check_src_data_rank(src_data_rank, mesh)
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
                size = local.shape[p.dim]
                length, start = chunk_size_and_offset(size, n, coord[k])
                if src is None:
                    local = local.narrow(p.dim, start, length)
                else:
                    local = _scatter_shard(local, p.dim, n, src, mesh, k, start, length)
            else:
                if src is not None and local.numel():
                    local = C.broadcast(local, mesh.group_ranks(k)[src], mesh.get_group(k))
                if isinstance(p, Partial) and p.reduce_op == "sum" and coord[k] != 0:
                    local = torch.zeros_like(local)
        local = local.contiguous()
        if local.data_ptr() == tensor.data_ptr() and not tensor.is_meta:
            local = local.clone()
    out = DTensor(local, DTensorSpec(mesh, pl, gshape), requires_grad=requires_grad)
    return out


def _scatter_shard(
    local: torch.Tensor, dim: int, n: int, src: int, mesh: DeviceMesh, k: int, start: int, length: int
) -> torch.Tensor:
    """Scatter ``torch.chunk``-style pieces of ``dim`` from group rank ``src`` of mesh dim ``k``;
    pieces are padded to the full chunk size for the collective and cut back to ``length``."""
    size = local.shape[dim]
    full = chunk_size(size, n)
    padded_shape = list(local.shape)
    padded_shape[dim] = full
    if 0 in padded_shape:  # the whole group holds nothing here: no collective
        return local.narrow(dim, start, length)
    chunks = None
    if mesh.get_coordinate()[k] == src:  # type: ignore[index]
        chunks = []
        for r in range(n):
            piece_len, piece_start = chunk_size_and_offset(size, n, r)
            piece = local.narrow(dim, piece_start, piece_len)
            if piece_len < full:
                pad = list(piece.shape)
                pad[dim] = full - piece_len
                piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
            chunks.append(piece)
    out_like = local.new_empty(padded_shape)
    out = C.scatter(chunks, out_like, mesh.group_ranks(k)[src], mesh.get_group(k))
    return out if length == full else out.narrow(dim, 0, length).contiguous()


__all__ = ["DTensor", "DTensorSpec", "distribute_tensor"]
