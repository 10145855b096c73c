"""Random MindSpore ops on DTensors: draw from the job-wide stream, keep this rank's slice.

The job-wide stream (``hp_dtensor.api.random_stream``) makes a replicated result identical on
every rank and a sharded result the matching slice of the one draw of the global tensor.
MindSpore reaches these ops in three ways, each closed here:

* ops that report to ``__fallback__`` (``mint.rand_like``, ``mint.randn_like``,
  ``Tensor.uniform_``, ``Tensor.normal_``) run the handlers below instead of the local kernel;
* ``ops.rand_like`` / ``ops.randn_like`` are Python functions that read ``input.shape`` and call
  a shape-only primitive, so no DTensor ever reaches ``__fallback__``: ``install`` replaces them
  in the ``mindspore.ops`` namespaces with versions that send a DTensor here (a reference taken
  with ``from mindspore.ops import rand_like`` *before* ``hp_dtensor`` was imported keeps the
  original; ``hp_dtensor.platform.mindspore.random_ops.rand_like`` is the entry point that always
  works);
* every other random op on a DTensor (bernoulli, multinomial, shuffle, exponential_, random_,
  ...) raises ``NotImplementedError``: drawn per rank it would diverge across ranks while its
  placements claim otherwise.

Placements of the result follow torch: an in-place fill keeps its tensor's placements (on a
``Partial("sum")`` mesh dim the draw is kept on coordinate 0 and zeros elsewhere, so the sum is the
draw; avg/max/min terms all hold it); a ``*_like`` op returns its input's placements with
``Partial`` read as ``Replicate``.  Initializers (``mindspore.common.initializer``) go through
``DTensor.set_data`` / ``distribute_tensor``, which materialize the global tensor on the source
rank's numpy state and broadcast it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.api.random_stream import Draw, agreed_seed, draw_local, manual_seed
from hp_dtensor.placement_types import Partial, partials_replicated
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.dispatch import random_op
from hp_dtensor.platform.mindspore.dtensor import DTensor, DTensorSpec
from hp_dtensor.sharding.random_ops import MINDSPORE_REFUSED_RANDOM_OPS


def _float_dtype(dtype: Any, op: str) -> Any:
    if not getattr(dtype, "is_floating_point", False):
        raise ValueError(f"{op}: a random DTensor needs a floating-point dtype, got {dtype}")
    return dtype


def like(dt: DTensor, kind: Draw, dtype: Any = None) -> DTensor:
    """A DTensor of fresh draws shaped and laid out like ``dt`` (``Partial`` read as ``Replicate``):
    ``Draw.UNIFORM`` is ``rand_like``, ``Draw.NORMAL`` is ``randn_like``."""
    if not isinstance(dt, DTensor):
        raise TypeError(f"expected a DTensor, got {type(dt).__name__}")
    spec = dt._spec
    out_pl = partials_replicated(spec.placements)
    dtype = _float_dtype(dtype if dtype is not None else dt.dtype, f"{kind.value} draw")
    values = draw_local(spec.mesh, spec.shape, out_pl, kind)
    return DTensor(C._from_numpy(values, dtype), DTensorSpec(spec.mesh, out_pl, spec.shape))


def rand_like(input: DTensor, *, dtype: Any = None) -> DTensor:
    """``ops.rand_like`` for DTensors: uniform [0, 1), dtype defaults to the input's."""
    return like(input, Draw.UNIFORM, dtype)


def randn_like(input: DTensor, *, dtype: Any = None) -> DTensor:
    """``ops.randn_like`` for DTensors: standard normal, dtype defaults to float32 (as MindSpore's)."""
    return like(input, Draw.NORMAL, dtype if dtype is not None else ms.float32)


def fill_(dt: DTensor, kind: Draw, scale: float, shift: float) -> DTensor:
    """Overwrite ``dt`` in place with ``shift + scale * draw`` (its placements kept)."""
    spec = dt._spec
    mesh = spec.mesh
    _float_dtype(dt.dtype, f"{kind.value} fill")
    values = draw_local(mesh, spec.shape, spec.placements, kind)
    values = (np.float32(shift) + np.float32(scale) * values).astype(np.float32)
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    if any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[k] != 0 for k, p in enumerate(spec.placements)):
        values = np.zeros_like(values)
    with NoFallbackGuard():
        C._plain(dt).copy_(C._from_numpy(values, dt.dtype))
    return dt


# ---------------------------------------------------------------- what __fallback__ reports
# Argument layouts as MindSpore 2.10 reports them: RandLikeExt(input, seed, offset, dtype, device),
# InplaceUniform(input, from, to, seed, offset), InplaceNormal(input, mean, std, seed, offset).
_TYPE_IDS: dict[int, Any] | None = None


def _dtype_of(type_id: Any) -> Any:
    """The MindSpore dtype behind the integer type id a pyboost op receives (None stays None)."""
    global _TYPE_IDS
    if type_id is None or not isinstance(type_id, int):
        return type_id
    if _TYPE_IDS is None:
        from mindspore.ops._utils.arg_handler import dtype_to_type_id

        _TYPE_IDS = {dtype_to_type_id("RandLikeExt", "dtype", d): d
                     for d in (ms.float16, ms.float32, ms.float64, ms.bfloat16)}
    if type_id not in _TYPE_IDS:
        raise ValueError(f"a random DTensor needs a floating-point dtype, got type id {type_id}")
    return _TYPE_IDS[type_id]


def _arg(args: tuple[Any, ...], i: int, default: Any = None) -> Any:
    return args[i] if len(args) > i else default


@random_op("RandLikeExt")
def _rand_like_ext(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return like(args[0], Draw.UNIFORM, _dtype_of(_arg(args, 3, kwargs.get("dtype"))))


@random_op("RandnLike")
def _randn_like(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return like(args[0], Draw.NORMAL, _dtype_of(_arg(args, 3, kwargs.get("dtype"))))


@random_op("InplaceUniform")
def _uniform_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    lo, hi = float(_arg(args, 1, 0.0)), float(_arg(args, 2, 1.0))
    return fill_(args[0], Draw.UNIFORM, hi - lo, lo)


@random_op("InplaceNormal")
def _normal_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    mean, std = float(_arg(args, 1, 0.0)), float(_arg(args, 2, 1.0))
    return fill_(args[0], Draw.NORMAL, std, mean)


def _refuse(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise NotImplementedError(
        f"random op {func.name} on a DTensor is not supported on MindSpore: drawn on each rank it would "
        f"differ across ranks; use mint.rand_like / ops.rand_like / randn_like / uniform_ / normal_ / "
        f"ops.dropout on the DTensor (one job-wide stream), or draw on .full_tensor() and distribute_tensor it"
    )


random_op(*MINDSPORE_REFUSED_RANDOM_OPS)(_refuse)


# ---------------------------------------------------------------- ops.rand_like / ops.randn_like
def _routed(original: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(input: Any, seed: Any = None, *, dtype: Any = None) -> Any:
        if not isinstance(input, DTensor):
            return original(input, seed, dtype=dtype)
        if seed is not None:
            raise ValueError(
                f"{original.__name__}(seed={seed!r}) on a DTensor: a per-call seed cannot be honoured alike on "
                f"every rank; seed the job-wide stream with hp_dtensor.manual_seed(seed, mesh) instead"
            )
        return ours(input, dtype=dtype)

    wrapper.__name__ = original.__name__
    wrapper.__doc__ = original.__doc__
    wrapper._hp_routed = True  # type: ignore[attr-defined]
    return wrapper


_SHAPE_ONLY = {"rand_like": rand_like, "randn_like": randn_like}
_NAMESPACES = ("mindspore.ops", "mindspore.ops.function", "mindspore.ops.functional",
               "mindspore.ops.function.random_func")


def install() -> None:
    """Replace ``ops.rand_like`` / ``ops.randn_like`` in MindSpore's namespaces (idempotent)."""
    from mindspore.ops.function import random_func

    for name, ours in _SHAPE_ONLY.items():
        original = getattr(random_func, name)
        if getattr(original, "_hp_routed", False):
            continue
        routed = _routed(original, ours)
        for mod_name in _NAMESPACES:
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, name, None) is original:
                setattr(mod, name, routed)


install()


class _MindSporeRNG:
    """MindSpore's ``RNGPrimitives`` (see ``hp_dtensor.api.rng_tracker``): the seed is the job-wide
    stream's, exchanged over mccl, so ``hp_dtensor.manual_seed(seed, mesh)`` seeds it and checks
    that every rank passed the same seed."""

    @staticmethod
    def set_seed(seed: int) -> None:
        manual_seed(seed)

    @staticmethod
    def broadcast_rng_state(mesh: Any) -> bool:
        # The stream's seed is agreed at first use (rank 0 picks it); a rank's own generator
        # state never enters a DTensor draw, so nothing on this rank changes.
        agreed_seed()
        return False


RNG = _MindSporeRNG()

__all__ = ["RNG", "fill_", "install", "like", "rand_like", "randn_like"]
