"""``DTensor`` for MindSpore: a ``Tensor`` subclass whose data is this rank's shard.

The object *is* the local tensor (``Tensor._make_subclass``), so MindSpore's autograd sees the
local computation directly; ``shape`` reports the global shape.  Every MindSpore op on it reaches
``__fallback__`` (see ``dispatch.py``), which redistributes inputs as the sharding rule asks and
runs the op on local data.  ``Parameter(DTensor)`` keeps the subclass, so a sharded module
parameter is a DTensor with placements and its gradient is the local one (see the gradient
convention in ``redistribute.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore._c_expression import NoFallbackGuard
from mindspore.ops.auto_generate.gen_ops_prim import Identity

from hp_dtensor.api import from_local_check
from hp_dtensor.api.dtensor_methods import distribute_with
from hp_dtensor.api.global_values import GlobalValueMethods
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.layout.dtensor_spec import DTensorSpec, resolve_mesh
from hp_dtensor.placement_types import (
    Placement,
    Replicate,
)
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.redistribute import KeepGradOnRoot, Redistribute
from hp_dtensor.sharding.local_grads import GradLayout


def _dispatch_not_installed(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError("the MindSpore backend's op dispatch is not installed; import hp_dtensor.platform.mindspore")


# The op dispatcher.  ``dispatch`` builds DTensors, so it imports this module; the backend package
# installs it here once both are loaded, which keeps the import graph free of loops.
_dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] = _dispatch_not_installed


def install_dispatch(fn: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> None:
    """Route every MindSpore op on a DTensor (``__fallback__``) to ``fn(func, args, kwargs)``."""
    global _dispatch
    _dispatch = fn


_IDENTITY = Identity()  # the primitive returns a plain Tensor (ops.identity keeps the subclass)

class DTensor(GlobalValueMethods, Tensor):  # type: ignore[misc]
    """A tensor laid out over a ``DeviceMesh`` by one placement per mesh dim (``shape``, sizes and
    Python values are the global tensor's: ``GlobalValueMethods``)."""

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
        return _dispatch(func, tuple(args), dict(kwargs or {}))

    # ----- a plain tensor on the left: ``plain + dtensor`` -----
    # MindSpore would ask the plain tensor's class for ``__fallback__`` (it has none) and fail
    # with an internal message.  Python tries a subclass's reflected operator first, so these run
    # instead: a one-element plain tensor joins as a replicated scalar, anything else is the
    # mixing error ``dispatch`` gives for plain tensors next to DTensors.
    def __radd__(self, other: Any) -> Any:
        return _reflected(self, other, "__add__", Tensor.__radd__)

    def __rsub__(self, other: Any) -> Any:
        return _reflected(self, other, "__sub__", Tensor.__rsub__)

    def __rmul__(self, other: Any) -> Any:
        return _reflected(self, other, "__mul__", Tensor.__rmul__)

    def __rtruediv__(self, other: Any) -> Any:
        return _reflected(self, other, "__truediv__", Tensor.__rtruediv__)

    def __rmatmul__(self, other: Any) -> Any:
        return _reflected(self, other, "__matmul__", Tensor.__rmatmul__)

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

    def set_data(self, data: Any, slice_shape: bool = False) -> Any:
        """``Parameter.set_data`` for a DTensor parameter: ``data`` is the *global* value (a Tensor
        of the global shape, a lazy ``mindspore.common.initializer`` tensor, a number) or a DTensor
        of the same spec.  A global value is laid out like ``distribute_tensor`` does it: rank 0 of
        each mesh dim materializes it (an initializer draws from rank 0's numpy state) and its
        values are broadcast, so a replicated parameter is identical on every rank and a sharded one
        is the slice of what one process would have initialized.  Collective: call on every rank."""
        if not isinstance(self, ms.Parameter):
            raise TypeError("set_data is a Parameter method; this DTensor is not a Parameter")
        spec = self._spec
        if isinstance(data, DTensor):
            if data._spec != spec:
                raise ValueError(
                    f"set_data: the DTensor's layout {data._spec.placements} / shape {data._spec.shape} differs from "
                    f"the parameter's {spec.placements} / {spec.shape}; redistribute it first"
                )
            local = C._plain(data)
        elif isinstance(data, (int, float)) and not isinstance(data, bool):
            local = ops.fill(self.dtype, spec.local_shape(), data)
        elif isinstance(data, Tensor):
            got = tuple(Tensor.shape.fget(data))
            if got != spec.shape:
                raise ValueError(
                    f"set_data on a DTensor parameter of global shape {spec.shape} got a tensor of shape {got}; pass "
                    f"the global value (rank 0's is laid out with {spec.placements}) or a DTensor of the same layout"
                )
            if data.dtype != self.dtype:
                data = (data.init_data() if getattr(data, "has_init", False) else data).astype(self.dtype)
            local = C._plain(distribute_tensor(data, spec.mesh, spec.placements))
        else:
            raise TypeError(f"set_data expects a Tensor, DTensor or number, got {type(data).__name__}")
        return ms.Parameter.set_data(self, local, slice_shape)

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
        if isinstance(self, ms.Parameter):
            # Autograd knows a Parameter by identity: a plain view of it would be a new leaf and
            # the parameter's gradient would silently be zero.  One native identity op keeps the
            # link (fallback off: it runs on this rank's data, not through DTensor dispatch).
            with NoFallbackGuard():
                # (the Identity primitive has no bfloat16 kernel on CPU; a reshape to the same
                # shape is the same link, and also returns a plain Tensor)
                local = _IDENTITY(self) if self.dtype != ms.bfloat16 else ops.reshape(self, self._spec.local_shape())
        else:
            local = Tensor._make_subclass(Tensor, self)
        # The caller's gradient for a plain tensor is whole on every rank.
        return self._whole_grad_use(local)

    def _whole_grad_use(self, local: Any) -> Any:
        """``local`` (this value, as some consumer will use it) adapted to a consumer whose
        backward hands back a whole gradient (see ``GradLayout``)."""
        layout = self._grad_layout
        on_root = () if layout is None else layout.whole_use()
        return KeepGradOnRoot.apply(local, self._spec.mesh, on_root) if on_root else local

    def _redistribute(self, dst: tuple[Placement, ...]) -> DTensor:
        spec = self._spec
        layout = GradLayout()
        out = DTensor(Redistribute.apply(self._whole_grad_use(self), spec.mesh, spec.shape, spec.placements, dst, layout),
                      DTensorSpec(spec.mesh, dst, spec.shape))
        out._grad_layout = layout
        return out

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

        Without ``shape`` the global shape assumes even sharding (as torch); uneven shards
        (``torch.chunk``-style) need ``shape``.  ``run_check=True`` first exchanges one fixed-size
        record per rank (ndim, shape, dtype, placements, ``shape``, a digest of the data's bytes),
        so the check itself cannot hang or mismatch; then every rank raises the same ``ValueError``
        naming each rank's value when the ranks disagree on ndim, dtype, placements or ``shape``,
        when the shards do not tile the global shape (equal shards without ``shape``), or when
        ranks sharing a ``Replicate`` mesh dim are not bit-identical (see
        ``hp_dtensor.api.from_local_check``)."""
        mesh = resolve_mesh(device_mesh, "from_local")
        if isinstance(local_tensor, DTensor):
            raise ValueError("from_local got a DTensor; pass its .to_local() or use .redistribute()")
        if not isinstance(local_tensor, Tensor):
            raise TypeError(f"from_local expects a mindspore.Tensor, got {type(local_tensor).__name__}")
        spec = from_local_check.spec_for_from_local(
            tuple(Tensor.shape.fget(local_tensor)), str(local_tensor.dtype), lambda: _data_bytes(local_tensor), mesh,
            placements, shape, stride, run_check, C.COLLECTIVES,
        )
        return DTensor(local_tensor, spec)


def _reflected(dt: DTensor, other: Any, forward: str, base: Any) -> Any:
    """``other <op> dt`` for a plain ``other`` (see ``DTensor.__radd__``)."""
    if not isinstance(other, Tensor) or isinstance(other, DTensor):
        return base(dt, other)
    shape = tuple(Tensor.shape.fget(other))
    if any(s != 1 for s in shape):
        raise RuntimeError(
            f"{forward.strip('_')}: got a mix of mindspore.Tensor (shape {shape}) and DTensor arguments; make the "
            f"tensor a DTensor with DTensor.from_local or distribute_tensor first"
        )
    mesh = dt._spec.mesh
    lifted = DTensor(other, DTensorSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), shape))
    return getattr(lifted, forward)(dt)


def _data_bytes(local: Tensor) -> memoryview:
    """The values' bytes in row-major order, as torch has them (so both digest alike)."""
    with NoFallbackGuard():
        a = np.ascontiguousarray(C._to_numpy(C._plain(local)))
    if local.dtype == ms.bfloat16:  # widened to float32 exactly: the top 16 bits are the bfloat16
        a = (a.view(np.uint32) >> 16).astype(np.uint16)
    return a.reshape(-1).view(np.uint8).data


class _Distribute:
    """MindSpore's ``DistributePrimitives``: a lazily initialized tensor (``has_init``) is
    materialized first; the layout's ops never reach the DTensor dispatch; the shard is a copy."""

    tensor_type = Tensor
    tensor_name = "mindspore.Tensor"
    dtensor_type = DTensor
    collectives = C.COLLECTIVES
    layout_context = NoFallbackGuard

    @staticmethod
    def source(tensor: Any) -> tuple[Tensor, bool]:
        if getattr(tensor, "has_init", False):
            tensor = tensor.init_data()
        return C._plain(tensor), True

    @staticmethod
    def shard(local: Tensor, tensor: Any, spec: DTensorSpec) -> DTensor:
        return DTensor(C.copy(local), spec)


_DISTRIBUTE = _Distribute()


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
    materialized yet (``has_init``, MindSpore's lazy initializer) is materialized on every rank
    and then treated alike: the source's draw is broadcast, so the ranks need not be seeded alike
    (with ``src_data_rank=None`` each rank keeps its own draw: seed them alike)."""
    return distribute_with(_DISTRIBUTE, tensor, device_mesh, placements, src_data_rank)  # type: ignore[no-any-return]


def as_parameter(dt: DTensor, old: Any) -> Any:
    """A ``Parameter`` holding ``dt`` (still a DTensor), with ``old``'s name and requires_grad."""
    name = getattr(old, "name", None)
    requires_grad = bool(getattr(old, "requires_grad", True))
    return ms.Parameter(dt, name=name, requires_grad=requires_grad)


__all__ = ["DTensor", "DTensorSpec", "distribute_tensor"]
