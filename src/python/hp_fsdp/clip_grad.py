"""Gradient-norm clipping over parameters sharded any way: ``clip_grad_norm_``,
``get_total_norm`` and ``clip_grads_with_norm_`` with the names and semantics of
``torch.nn.utils``, for a mix of plain tensors and DTensors on different meshes (FSDP's
``Shard(0)`` on the data-parallel ranks, TP's ``Shard``/``Replicate``, both on a 2-D mesh).

The total norm is the norm of the per-tensor norms.  Each rank computes, for every tensor, the
partial value its shard contributes (``|x|^p`` summed for a p-norm, the largest/smallest ``|x|``
for the inf norms); tensors whose shards lie along the same mesh dims are reduced together, in
one collective per mesh dim (sum, or max/min with NaN kept), through the DTensor API.  Only
``Shard`` mesh dims are reduced: a ``Replicate`` dim holds the same values on every rank and
must not be counted twice.  A ``Partial`` gradient is first reduced to ``Replicate`` on its
partial dims (the norm of a sum is not the sum of norms); its shards are then scaled in place,
which scales the sum.  Plain tensors are taken as they are on this rank, as in torch (under data
parallelism their gradients are the same on every rank).

Every rank returns the same total (NaN and inf included) and scales every gradient's local data
in place by ``min(max_norm / (total + 1e-6), 1)``.  The parameters, and which of them have a
gradient, must be the same on every rank of a mesh, as for any collective.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hp_dtensor import DeviceMesh, Partial, Placement, Replicate, Shard
from hp_dtensor.platform import current as _platform
from hp_fsdp.norm_primitives import GradNormPrimitives, Tensor, grad_norm_primitives

TensorOrTensors = Any  # a tensor, or an iterable of tensors (the framework's, DTensors included)


@dataclass(frozen=True)
class _Reduction:
    """The ranks whose shards of a tensor together hold it: ``dims`` of ``mesh`` (``mesh`` None:
    this rank holds every element it counts, nothing to reduce)."""

    mesh: DeviceMesh | None
    dims: tuple[int, ...]


_LOCAL = _Reduction(None, ())


_REDUCTIONS: dict[tuple[DeviceMesh, tuple[int, ...]], _Reduction] = {}


def _reduction(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> _Reduction:
    """Where the partial norms of a DTensor with these (non-Partial) placements are reduced.

    On a named mesh the reduced dims are sliced out, so tensors on different meshes that are
    sharded over the same ranks (a plain parameter on ``mesh['dp']`` and a TP+FSDP one on
    ``(tp, dp)`` that is Replicate on tp) share one reduction.  Memoized: a training step asks
    for every parameter."""
    dims = tuple(k for k, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(k) > 1)
    if not dims:
        return _LOCAL
    red = _REDUCTIONS.get((mesh, dims))
    if red is None:
        names = mesh.mesh_dim_names
        if names is not None and len(dims) < mesh.ndim:
            red = _Reduction(mesh[tuple(names[k] for k in dims)], tuple(range(len(dims))))
        else:
            red = _Reduction(mesh, dims)
        _REDUCTIONS[(mesh, dims)] = red
    return red


def _norm_type(norm_type: Any) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"norm_type must be a number (2.0, 1, float('inf'), ...), got {norm_type!r}") from None
    if math.isnan(p):
        raise ValueError("norm_type is NaN; pass a number such as 2.0 or float('inf')")
    return p


def _max_norm(max_norm: Any) -> float:
    try:
        m = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"max_norm must be a number, got {max_norm!r}") from None
    if not m >= 0:
        raise ValueError(
            f"max_norm must be >= 0, got {m}: a negative (or NaN) max_norm would flip (or poison) every "
            f"gradient instead of clipping it"
        )
    return m


def _as_list(prims: GradNormPrimitives, items: TensorOrTensors, what: str) -> list[Any]:
    if prims.is_tensor(items):
        return [items]
    if not isinstance(items, Iterable):
        raise TypeError(f"{what} must be a tensor or an iterable of tensors, got {type(items).__name__}")
    out = list(items)
    for i, t in enumerate(out):
        if not prims.is_tensor(t):
            raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a tensor")
    return out


def _shard_of(prims: GradNormPrimitives, t: Tensor) -> tuple[_Reduction, Tensor]:
    """The reduction ``t``'s norm needs and the local data that enter it."""
    if not prims.is_dtensor(t):
        return _LOCAL, t
    mesh: DeviceMesh = t.device_mesh
    placements: tuple[Placement, ...] = tuple(t.placements)
    if any(isinstance(p, Partial) for p in placements):
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        t = t.redistribute(mesh, placements)
    return _reduction(mesh, placements), prims.local_of(t)


def _reduce(v: Tensor, red: _Reduction, op: str) -> Tensor:
    """``v`` reduced by ``op`` over ``red.dims`` of ``red.mesh``: a Partial DTensor made whole."""
    assert red.mesh is not None
    placements = [Partial(op) if k in red.dims else Replicate() for k in range(red.mesh.ndim)]  # type: ignore[arg-type]
    dt = _platform().DTensor.from_local(v, red.mesh, placements)
    return dt.full_tensor()


def _shard_as_param(prims: GradNormPrimitives, g: Tensor, param: Any) -> tuple[_Reduction, Tensor]:
    """A plain (local) gradient of a DTensor parameter is laid out as the parameter: MindSpore's
    ``value_and_grad`` over sharded parameters returns their shards as plain tensors."""
    if prims.is_dtensor(g) or param is None or not prims.is_dtensor(param):
        return _shard_of(prims, g)
    placements: tuple[Placement, ...] = tuple(param.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            f"clip_grads: parameter {prims.describe(param)} is Partial; a plain gradient of it has no "
            f"known layout. Pass the gradient as a DTensor"
        )
    return _reduction(param.device_mesh, placements), prims.local_of(g)


def _total_norm(
    prims: GradNormPrimitives,
    tensors: list[Tensor],
    p: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
    params: list[Any] | None = None,
) -> Tensor:
    if not tensors:
        return prims.zero_norm()
    for i, t in enumerate(tensors):
        if not prims.is_floating(t):
            raise TypeError(f"get_total_norm: tensor {i} is a {prims.describe(t)}; norms need floating-point tensors")
    groups: dict[_Reduction, list[Tensor]] = {}  # first-seen order: the same on every rank
    for k, t in enumerate(tensors):
        red, local = _shard_as_param(prims, t, None if params is None else params[k])
        groups.setdefault(red, []).append(local)
    op = "max" if p == math.inf else "min" if p == -math.inf else "sum"
    parts = []
    for red, locals_ in groups.items():
        v = prims.partials(locals_, p, foreach)
        parts.append(v if red.mesh is None else _reduce(v, red, op))
    total = prims.total(parts, p, [x for xs in groups.values() for x in xs])
    if error_if_nonfinite and not prims.is_finite(total):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be "
            f"clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`"
        )
    return total


def get_total_norm(
    tensors: TensorOrTensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> Tensor:
    """The ``norm_type``-norm of all ``tensors`` viewed as one vector (the norm of their norms),
    whole-tensor values for DTensors, the same 0-d tensor on every rank.

    ``error_if_nonfinite``: raise ``RuntimeError`` (on every rank) when it is NaN or inf.
    ``foreach``: as torch (None: the foreach kernels where the device has them)."""
    prims = grad_norm_primitives()
    items = _as_list(prims, tensors, "tensors")
    p = _norm_type(norm_type)
    with prims.no_grad():
        return _total_norm(prims, items, p, bool(error_if_nonfinite), foreach)


def _grads(prims: GradNormPrimitives, params: list[Any]) -> list[Tensor]:
    return [g for g in (prims.grad_of(x) for x in params) if g is not None]


def clip_grads_with_norm_(
    parameters: TensorOrTensors, max_norm: float, total_norm: Tensor, foreach: bool | None = None
) -> None:
    """Scale every gradient of ``parameters`` in place by ``min(max_norm / (total_norm + 1e-6), 1)``
    (a DTensor gradient through its local data; ``total_norm`` from ``get_total_norm``)."""
    prims = grad_norm_primitives()
    params = _as_list(prims, parameters, "parameters")
    m = _max_norm(max_norm)
    if not prims.is_tensor(total_norm):
        raise TypeError(f"total_norm must be the tensor get_total_norm returned, got {type(total_norm).__name__}")
    with prims.no_grad():
        if prims.is_dtensor(total_norm):
            total_norm = total_norm.full_tensor()
        grads = _grads(prims, params)
        if grads:
            prims.scale_([prims.local_of(g) for g in grads], m, total_norm, foreach)


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip the gradients of ``parameters`` (plain or DTensor, any meshes) to total norm
    ``max_norm`` in place; returns the total norm before clipping, the same on every rank.
    Gradients that are None are skipped."""
    prims = grad_norm_primitives()
    is_generator = isinstance(parameters, types.GeneratorType)
    params = _as_list(prims, parameters, "parameters")
    if is_generator and not params:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    m = _max_norm(max_norm)
    p = _norm_type(norm_type)
    with prims.no_grad():
        grads = _grads(prims, params)
        total = _total_norm(prims, grads, p, bool(error_if_nonfinite), foreach)
        if grads:
            prims.scale_([prims.local_of(g) for g in grads], m, total, foreach)
    return total


def clip_grads(
    grads: TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    parameters: TensorOrTensors | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> tuple[tuple[Tensor | None, ...], Tensor]:
    """Clip ``grads`` (the tuple ``mindspore.value_and_grad`` returns; any framework) to total
    norm ``max_norm``, out of place: returns ``(clipped, total_norm)``, ``clipped`` new tensors
    ``g * min(max_norm / (total_norm + 1e-6), 1)`` in the order of ``grads`` (None stays None) and
    ``total_norm`` the ``norm_type``-norm before clipping, the same 0-d tensor on every rank.

    ``parameters``: the parameters ``grads`` belong to, in the same order; a plain gradient of a
    DTensor parameter is taken as its local shard, laid out as the parameter (FSDP's ``Shard``,
    HSDP's ``Replicate``, TP's), so the norm is reduced over the mesh dims it is sharded on.
    Without it (or for a plain parameter) a plain gradient counts as this rank's whole tensor.
    For MindSpore, where parameters hold no ``.grad`` and tensors are not reliably updated in
    place, this is the form to use::

        loss, grads = grad_fn(x, y)
        grads, norm = clip_grads(grads, 1.0, parameters=net.trainable_params())
    """
    prims = grad_norm_primitives()
    items = list(grads) if not prims.is_tensor(grads) else [grads]
    for i, g in enumerate(items):
        if g is not None and not prims.is_tensor(g):
            raise TypeError(f"grads[{i}] is a {type(g).__name__}, not a tensor or None")
    params: list[Any] | None = None
    if parameters is not None:
        params = _as_list(prims, parameters, "parameters")
        if len(params) != len(items):
            raise ValueError(
                f"clip_grads: {len(items)} gradients but {len(params)} parameters; pass the parameters "
                f"the gradients were taken of, in the same order"
            )
    m = _max_norm(max_norm)
    p = _norm_type(norm_type)
    live = [k for k, g in enumerate(items) if g is not None]
    with prims.no_grad():
        total = _total_norm(
            prims, [items[k] for k in live], p, bool(error_if_nonfinite), foreach,
            None if params is None else [params[k] for k in live],
        )
        out: list[Tensor | None] = list(items)
        if live:
            scaled = prims.scaled([prims.local_of(items[k]) for k in live], m, total)
            for k, new in zip(live, scaled):
                g = items[k]
                if prims.is_dtensor(g):
                    new = _platform().DTensor.from_local(new, g.device_mesh, tuple(g.placements), shape=tuple(g.shape))
                out[k] = new
    return tuple(out), total


__all__ = ["clip_grad_norm_", "clip_grads", "clip_grads_with_norm_", "get_total_norm"]
