"""``DTensor`` for torch: a wrapper tensor subclass holding this rank's shard.

The wrapper has the global shape and dtype; ``_local_tensor`` holds the local shard.  Every aten op
on it goes through ``__torch_dispatch__`` (see ``dispatch.py``), below autograd, so backward ops
are dispatched the same way and parameter gradients come out as DTensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_dtensor.api import from_local_check
from hp_dtensor.api.dtensor_methods import DTensorMethods, distribute_with
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.layout.dtensor_spec import DTensorSpec, resolve_mesh
from hp_dtensor.placement_types import Placement, normalize_placements
from hp_dtensor.platform.torch import collectives as C
from hp_dtensor.platform.torch.redistribute import grad_placements, redistribute_local
from hp_dtensor.sharding.strides import global_strides


def _dispatch_not_installed(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    raise RuntimeError("the torch backend's op dispatch is not installed; import hp_dtensor.platform.torch")


# The op dispatcher.  ``dispatch`` builds DTensors, so it imports this module; the backend package
# installs it here once both are loaded, which keeps the import graph free of loops.
_dispatch: Callable[[Any, Any, dict[str, Any]], Any] = _dispatch_not_installed


def install_dispatch(fn: Callable[[Any, Any, dict[str, Any]], Any]) -> None:
    """Route every aten op on a DTensor to ``fn(func, args, kwargs)``."""
    global _dispatch
    _dispatch = fn


class DTensor(DTensorMethods, torch.Tensor):
    """A tensor laid out over a ``DeviceMesh`` by one placement per mesh dim."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=global_strides(
                local_tensor.stride(), spec.mesh.shape, spec.placements, spec.shape, local_tensor.is_contiguous()
            ),
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
        return _dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    # ----- torch.distributed.checkpoint extension hooks (see dcp_hooks.py) -----
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from hp_dtensor.platform.torch import dcp_hooks as dcp

        return dcp.create_write_items(self._local_tensor, self._spec, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        from hp_dtensor.platform.torch import dcp_hooks as dcp

        return dcp.create_chunk_list(self._spec)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        from hp_dtensor.platform.torch import dcp_hooks as dcp

        return dcp.get_tensor_shard(self._local_tensor, self._spec, index)

    # ----- what DTensorMethods needs from the backend -----
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard; differentiable (the gradient comes back with ``grad_placements``,
        default this tensor's placements)."""
        gp = None
        if grad_placements is not None:
            gp = normalize_placements(tuple(grad_placements), self._spec.mesh.ndim, self.ndim)
        if not torch.is_grad_enabled():
            return self._local_tensor
        return ToLocal.apply(self, gp)  # type: ignore[no-any-return]

    def _redistribute(self, dst: tuple[Placement, ...]) -> DTensor:
        return Redistribute.apply(self, self._spec.mesh, dst)  # type: ignore[no-any-return]

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
        placements, ``shape``, a digest of the data's bytes) and raises the same ``ValueError`` on
        every rank, naming each rank's value, when they do not describe one DTensor -- including
        ``Replicate`` shards that are not bit-identical (see ``hp_dtensor.api.from_local_check``)."""
        spec = from_local_check.spec_for_from_local(
            local_tensor.shape, str(local_tensor.dtype), lambda: _data_bytes(local_tensor),
            resolve_mesh(device_mesh, "from_local"), placements, shape, stride, run_check, C.COLLECTIVES,
        )
        return FromLocal.apply(local_tensor, spec)  # type: ignore[no-any-return]


def _data_bytes(t: torch.Tensor) -> memoryview:
    """The values' bytes in row-major order (a meta tensor has none)."""
    if t.is_meta:
        return memoryview(b"")
    flat = t.detach().resolve_conj().resolve_neg().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().data  # type: ignore[no-any-return]


class _Distribute:
    """torch's ``DistributePrimitives``: the layout runs without autograd recording; a meta tensor
    never communicates; the shard is contiguous and never the caller's storage."""

    tensor_type = torch.Tensor
    tensor_name = "torch.Tensor"
    dtensor_type = DTensor
    collectives = C.COLLECTIVES
    layout_context = staticmethod(torch.no_grad)

    @staticmethod
    def source(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return tensor.detach(), not tensor.is_meta

    @staticmethod
    def shard(local: torch.Tensor, tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
        local = local.contiguous()
        if not tensor.is_meta and local.data_ptr() == tensor.data_ptr():
            local = local.clone()
        return DTensor(local, spec, requires_grad=tensor.requires_grad)


_DISTRIBUTE = _Distribute()


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
    return distribute_with(_DISTRIBUTE, tensor, device_mesh, placements, src_data_rank)  # type: ignore[no-any-return]


# ----- autograd adapters: each layout change is differentiable, its dual runs in backward -----
class Redistribute(torch.autograd.Function):
    """DTensor -> DTensor with new placements; backward redistributes the gradient back."""

    @staticmethod
    def forward(ctx: Any, dt: Any, mesh: Any, dst: tuple[Placement, ...]) -> Any:  # type: ignore[override]
        spec = dt._spec
        ctx.src_spec = spec
        local = redistribute_local(dt._local_tensor, mesh, spec.shape, spec.placements, dst)
        if local is dt._local_tensor:
            local = local.view_as(local)
        return DTensor(local, DTensorSpec(mesh, dst, spec.shape))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        target = grad_placements(ctx.src_spec.placements)
        g = grad._spec
        return DTensor(_grad_local(grad, target), DTensorSpec(g.mesh, target, g.shape)), None, None


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: Any) -> Any:  # type: ignore[override]
        ctx.spec = spec
        return DTensor(local.view_as(local), spec)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        return _grad_local(grad, grad_placements(ctx.spec.placements)), None


def _grad_local(grad: Any, target: tuple[Placement, ...]) -> torch.Tensor:
    """The local shard of the DTensor gradient ``grad`` laid out as ``target``."""
    g = grad._spec
    return redistribute_local(grad._local_tensor, g.mesh, g.shape, g.placements, target)  # type: ignore[no-any-return]


class ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: Any, grad_pl: tuple[Placement, ...] | None) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = dt._spec
        ctx.grad_pl = grad_pl
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        spec = ctx.spec
        pl = ctx.grad_pl if ctx.grad_pl is not None else spec.placements
        return DTensor(grad.contiguous(), DTensorSpec(spec.mesh, pl, spec.shape)), None


__all__ = ["DTensor", "DTensorSpec", "distribute_tensor", "install_dispatch"]
