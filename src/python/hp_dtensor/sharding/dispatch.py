"""The op-dispatch skeleton every backend shares: cache key, mesh check, decision, fallback, fill, wrap.

A backend hands each op on DTensors here with its arguments; it supplies only primitives (how to
flatten its argument structures, call the local op, name an op, make a DTensor from a local
tensor and a spec).  Everything that decides is written once below:

- ``call_key``: the decision-cache key, structural and type-exact (``1``, ``1.0`` and ``True``
  never share a decision; ``[a]`` and ``(a,)`` neither), with every DTensor's spec and dtype.
- ``DispatchCore.decide``: rule look-up, the even layout rules see for uneven inputs, the
  uneven pointwise shortcut, the replicate fallback with its one warning per op.
- ``CachedCall``: a decision together with what the steady state needs and nothing else: the
  output specs (built once, not per call) and whether the call is *direct* (every DTensor input
  stays where it is, the op runs on the shards and one output is wrapped with a known spec).
- ``fill_placeholders``: rewritten arguments get the (redistributed) local tensors in place of
  their ``TensorInfo`` placeholders.
- ``flatten_one_level`` / ``unflatten_one_level``: op arguments as a flat list of leaves (lists
  opened one level, what ops take) and back; ``shared_mesh``: the mixing rule between plain
  tensors and DTensors; ``wrap_leaves``: which decision output each tensor output takes.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.layout.dtensor_spec import DTensorSpec
from hp_dtensor.layout.shard_geometry import even_placements, global_shape
from hp_dtensor.placement_types import Placement, Replicate
from hp_dtensor.sharding.op_call import Decision, OpCall, Rule, TensorInfo, map_leaves
from hp_dtensor.sharding.uneven import uneven_pointwise_rule

# Separates positional from keyword arguments in a key: ``f(x, "dim")`` is not ``f(x, dim=...)``.
_KW = object()
_CACHE_LIMIT = 16384


def call_key(
    op: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    dtensor_type: Any,
    tensor_type: Any,
    tensor_key: Callable[[Any], Any],
    value_free_floats: bool,
) -> tuple[Any, ...] | None:
    """The decision-cache key of one call, or None where an argument is a dict (the call is then
    decided afresh).  A key may still hold an unhashable value: look it up with
    ``DispatchCore.lookup``.

    Every leaf adds two entries, a DTensor three: its spec, its dtype (a dtype can change an output
    shape, e.g. a view as another dtype) and the identity of its mesh object (meshes sliced from
    different roots can compare equal, but a cached output spec holds the first call's mesh and
    ``fully_shard`` reads a parameter's root mesh; the key holds the spec, so the id stays unique);
    a plain tensor ``tensor_type`` and what ``tensor_key`` says, anything else its class and value -- or only ``float`` for a float when ``value_free_floats``
    (a pointwise rule never looks at a number's value, so an optimizer's changing step sizes
    share one decision).  A list or tuple adds its type and length before its items."""
    parts: list[Any] = [op]
    add = parts.append
    for x in args:  # the common leaves inline (this runs on every op); the rest in _add_leaves
        c = x.__class__
        if c is dtensor_type:
            add(x._spec)
            add(x.dtype)
            add(id(x._spec.mesh))
        elif c is int:
            add(int)
            add(x)
        elif c is float and value_free_floats:
            add(float)
            add(None)
        elif not _add_leaves(parts, (x,), dtensor_type, tensor_type, tensor_key, value_free_floats):
            return None
    if kwargs:
        parts.append(_KW)
        for name, value in kwargs.items():
            parts.append(name)
            if not _add_leaves(parts, (value,), dtensor_type, tensor_type, tensor_key, value_free_floats):
                return None
    return tuple(parts)


def _add_leaves(
    parts: list[Any],
    items: Sequence[Any],
    dtensor_type: Any,
    tensor_type: Any,
    tensor_key: Callable[[Any], Any],
    value_free_floats: bool,
) -> bool:
    add = parts.append
    for x in items:
        c = x.__class__
        if c is dtensor_type:
            add(x._spec)
            add(x.dtype)
            add(id(x._spec.mesh))
        elif c is int or c is bool or c is str or x is None:
            add(c)
            add(x)
        elif c is float:
            add(float)
            add(None if value_free_floats else x)
        elif c is list or c is tuple:
            add((c, len(x)))
            if not _add_leaves(parts, x, dtensor_type, tensor_type, tensor_key, value_free_floats):
                return False
        elif isinstance(x, dtensor_type):
            add(x._spec)
            add(x.dtype)
            add(id(x._spec.mesh))
        elif isinstance(x, tensor_type):
            add(tensor_type)
            add(tensor_key(x))
        elif isinstance(x, (list, tuple, dict)):
            return False
        else:
            add(c)
            add(x)
    return True


@dataclass(frozen=True, slots=True)
class CachedCall:
    """A decision plus what running it needs on every later call with the same key.

    ``out_specs``: per tensor output, its spec (built once), or None where the wrap must infer the
    global shape from the local output (an op meta tensors cannot run, on even inputs).
    ``direct``: no input moves, no argument is rewritten, no kernel, not in place, every DTensor
    is a top-level argument and the op returns one tensor whose spec is ``out_specs[0]``: the
    steady state is the local call and one wrap.
    ``direct_inplace``: the same for an op that writes its first argument and leaves it in its
    own layout (a gradient accumulated into a parameter's): the steady state is the local call,
    which returns that argument.
    ``extra``: what a backend derives from the decision once (MindSpore's gradient bookkeeping).
    ``memo``: what a backend derives per call from the entry and a local property, kept across
    calls (torch: the wrapper strides for each local output stride)."""

    decision: Decision
    is_fallback: bool
    out_specs: tuple[DTensorSpec | None, ...] | None
    direct: bool
    extra: Any = None
    direct_inplace: bool = False
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def output_spec(self, j: int, ti: int, mesh: DeviceMesh, local_shape: tuple[int, ...]) -> DTensorSpec | None:
        """The spec of output ``j`` (its position among outputs, ``None`` holes included), the
        ``ti``-th tensor output, whose local shape is ``local_shape``; None: not a DTensor."""
        outs = self.decision.outputs
        pl = outs[min(j, len(outs) - 1)] if outs else None
        if pl is None:
            return None
        if self.out_specs is not None and ti < len(self.out_specs):
            spec = self.out_specs[ti]
            if spec is not None and spec.placements == pl:
                return spec
        shape = self.decision.out_shape or global_shape(local_shape, mesh.shape, pl)
        return DTensorSpec(mesh, pl, shape)


def make_cached_call(
    decision: Decision,
    is_fallback: bool,
    mesh: DeviceMesh,
    actual: Sequence[tuple[Placement, ...]],
    out_shapes: Sequence[tuple[int, ...]] | None,
    *,
    single_tensor_output: bool,
    top_level_only: bool,
    inplace: bool,
    extra: Any = None,
) -> CachedCall:
    """``decision`` with its output specs built once and whether the steady state is direct.

    ``actual``: the DTensor inputs' placements (flat order); ``out_shapes``: global shapes of the
    tensor outputs (None: inferred per call); ``top_level_only``: no DTensor sits inside a list."""
    outs = decision.outputs
    specs: tuple[DTensorSpec | None, ...] | None = None
    shapes: Sequence[tuple[int, ...]] | None = out_shapes
    if shapes is None and decision.out_shape is not None and outs:
        shapes = [decision.out_shape] * len(outs)
    if shapes is not None and outs:
        specs = tuple(
            DTensorSpec(mesh, pl, tuple(shape)) if pl is not None else None
            for pl, shape in zip((outs[min(i, len(outs) - 1)] for i in range(len(shapes))), shapes)
        )
    moves = any(t is not None and t != a for t, a in zip(decision.inputs, actual))
    local_only = (
        single_tensor_output
        and top_level_only
        and not moves
        and not is_fallback
        and decision.args is None
        and decision.kwargs is None
        and decision.kernel is None
        and len(outs) == 1
    )
    direct = local_only and not inplace and specs is not None and len(specs) == 1 and specs[0] is not None
    # in place: the written argument keeps its layout, so the call changes no spec
    direct_inplace = local_only and inplace and bool(actual) and outs[0] == actual[0]
    return CachedCall(decision, is_fallback, specs, direct, extra, direct_inplace=direct_inplace)


def fill_placeholders(
    decision: Decision,
    dt_locals: Sequence[Any],
    n_in_args: int,
    local_args: tuple[Any, ...],
    local_kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the local call: a decision's rewritten ``args``/``kwargs`` with its
    ``TensorInfo`` placeholders replaced, in order, by the local tensors ``dt_locals`` (the first
    ``n_in_args`` belong to the positional arguments); the originals where it rewrote nothing."""
    if decision.args is None and decision.kwargs is None:
        return local_args, local_kwargs
    it = iter(dt_locals)

    def fill(x: Any) -> Any:
        return next(it) if isinstance(x, TensorInfo) else x

    if decision.args is not None:
        local_args = map_leaves(fill, decision.args)
    else:
        for _ in range(n_in_args):
            next(it)
    if decision.kwargs is not None:
        local_kwargs = map_leaves(fill, decision.kwargs)
    return local_args, local_kwargs


_CONTAINERS = (list, tuple, dict)


def flatten_one_level(values: Iterable[Any], flat: list[Any]) -> tuple[Any, ...] | None:
    """Append the leaves of ``values`` to ``flat``, a list or tuple opened one level: per value
    None (a leaf) or ``(type, length)``.  None where a value is a dict, a subclass of list or tuple,
    or a list holding a container: the caller flattens that its own way."""
    shape: list[Any] = []
    for v in values:
        c = v.__class__
        if c is list or c is tuple:
            for x in v:
                if isinstance(x, _CONTAINERS):
                    return None
            flat.extend(v)
            shape.append((c, len(v)))
        elif isinstance(v, _CONTAINERS):
            return None
        else:
            flat.append(v)
            shape.append(None)
    return tuple(shape)


def unflatten_one_level(flat: Sequence[Any], pos: int, shape: Sequence[Any]) -> tuple[list[Any], int]:
    """The values ``flatten_one_level`` gave ``shape`` for, rebuilt from ``flat`` from ``pos`` on;
    with the position after them."""
    out: list[Any] = []
    for item in shape:
        if item is None:
            out.append(flat[pos])
            pos += 1
        else:
            typ, n = item
            out.append(typ(flat[pos : pos + n]))
            pos += n
    return out, pos


class OneLevelSpec:
    """Args and kwargs nested at most one level in lists/tuples (what aten ops take), as
    ``flatten_call`` found them: rebuilt without a generic tree library's (slower) machinery.
    ``arg_shape``/``kw_shape`` hold, per argument, None for a leaf or (type, length)."""

    __slots__ = ("arg_shape", "keys", "kw_shape", "key")

    def __init__(self, arg_shape: tuple[Any, ...], keys: tuple[str, ...], kw_shape: tuple[Any, ...]) -> None:
        self.arg_shape = arg_shape
        self.keys = keys
        self.kw_shape = kw_shape
        # The structure goes into the decision cache key: sum(x, [0, 1]) and sum(x, 0, 1) flatten
        # to the same leaves.
        self.key = (arg_shape, keys, kw_shape)

    def unflatten(self, flat: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, pos = unflatten_one_level(flat, 0, self.arg_shape)
        kwargs, _ = unflatten_one_level(flat, pos, self.kw_shape)
        return tuple(args), dict(zip(self.keys, kwargs))

    def n_arg_leaves(self) -> int:
        """How many of the flat leaves are positional arguments (the rest are keyword arguments)."""
        return sum(1 if s is None else s[1] for s in self.arg_shape)


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], OneLevelSpec] | None:
    """The leaves of ``args`` then ``kwargs`` opened one level, with how to rebuild them; None
    where they nest deeper (the caller flattens those its own way)."""
    flat: list[Any] = []
    arg_shape = flatten_one_level(args, flat)
    kw_shape = flatten_one_level(kwargs.values(), flat) if arg_shape is not None else None
    if arg_shape is None or kw_shape is None:
        return None
    return flat, OneLevelSpec(arg_shape, tuple(kwargs), kw_shape)


def flatten_prim_args(args: tuple[Any, ...], dtensor_type: Any) -> tuple[list[Any], tuple[Any, ...]]:
    """Leaves of ``args`` with lists/tuples opened one level (MindSpore ops take at most a list of
    tensors, or a primitive call ``(prim, name, [inputs])``) and the shape that rebuilds them
    (``unflatten_one_level``).  A list or tuple inside an opened one (a primitive's axis list:
    ``(prim, "ReduceSum", [x, [0, 1], ...])``) stays whole as one leaf; a DTensor that deep is
    refused."""
    flat: list[Any] = []
    shape = flatten_one_level(args, flat)
    if shape is not None:
        return flat, shape
    flat = []
    parts: list[Any] = []
    for a in args:
        if type(a) in (list, tuple):
            flat.extend(a)
            parts.append((type(a), len(a)))
        else:
            flat.append(a)
            parts.append(None)
    if any(isinstance(x, _CONTAINERS) and holds_dtensor(x, dtensor_type) for x in flat):
        raise NotImplementedError(
            "a DTensor argument nested more than one list deep is not supported; pass it directly"
        )
    return flat, tuple(parts)


def holds_dtensor(x: Any, dtensor_type: Any) -> bool:
    """Whether ``x`` is, or holds in its lists, tuples and dicts, a DTensor (a foreach op's
    one-entry call without one runs as a plain call)."""
    if isinstance(x, dtensor_type):
        return True
    if isinstance(x, (list, tuple)):
        return any(holds_dtensor(y, dtensor_type) for y in x)
    if isinstance(x, dict):
        return any(holds_dtensor(y, dtensor_type) for y in x.values())
    return False


def shared_mesh(
    op: Any,
    leaves: Iterable[Any],
    dtensor_type: Any,
    tensor_type: Any,
    tensor_name: str,
    shape_of: Callable[[Any], tuple[int, ...]],
    may_join: Callable[[Any, tuple[int, ...]], bool],
) -> tuple[DeviceMesh, bool]:
    """The mesh the DTensor leaves of one op share, and whether a plain tensor with a dimension
    joins them (as Replicate; ``may_join`` says where the backend allows it).  Anywhere else such
    a tensor next to a DTensor is an error naming it: the op would mix a global value with shards."""
    mesh = None
    joined = False
    for leaf in leaves:
        if isinstance(leaf, dtensor_type):
            mesh = check_mesh(op, mesh, leaf._spec.mesh)
        elif isinstance(leaf, tensor_type):
            shape = shape_of(leaf)
            if shape:
                if not may_join(leaf, shape):
                    raise RuntimeError(
                        f"{op}: got a mix of {tensor_name} (shape {shape}) and DTensor arguments; make the "
                        f"tensor a DTensor with DTensor.from_local or distribute_tensor first"
                    )
                joined = True
    if mesh is None:
        raise NotImplementedError(
            f"{op}: a DTensor argument nested more than one list deep is not supported; pass it directly"
        )
    return mesh, joined


def wrap_leaves(
    leaves: Iterable[Any],
    mesh: DeviceMesh,
    entry: CachedCall,
    tensor_type: Any,
    shape_of: Callable[[Any], tuple[int, ...]],
    wrap: Callable[[Any, DTensorSpec], Any],
) -> list[Any]:
    """An op's output leaves with each tensor wrapped as the DTensor its decision gives: a tensor
    takes the decision output at its position among outputs, counting ``None`` holes (what rules
    list), and its spec by its index among tensor outputs."""
    res: list[Any] = []
    j = 0
    ti = 0
    for leaf in leaves:
        if isinstance(leaf, tensor_type):
            spec = entry.output_spec(j, ti, mesh, shape_of(leaf))
            j += 1
            ti += 1
            res.append(leaf if spec is None else wrap(leaf, spec))
        else:
            if leaf is None:
                j += 1
            res.append(leaf)
    return res


def check_mesh(op: Any, mesh: DeviceMesh | None, other: DeviceMesh) -> DeviceMesh:
    """The mesh every DTensor argument of one op shares: ``other`` joins ``mesh`` or raises."""
    if mesh is None:
        return other
    if other is not mesh and other != mesh:
        raise ValueError(f"{op}: DTensor arguments live on different meshes ({mesh} and {other})")
    return mesh


class DispatchCore:
    """One backend's decision cache and warned-once set."""

    def __init__(self, fallback_label: Callable[[str], str]) -> None:
        self.cache: dict[Any, CachedCall] = {}
        self.warned: set[str] = set()
        self._fallback_label = fallback_label

    def lookup(self, key: tuple[Any, ...] | None) -> tuple[tuple[Any, ...] | None, CachedCall | None]:
        """``(key, entry)``: the cached entry (None on a miss); the key becomes None where it
        holds an unhashable value (then nothing is stored)."""
        if key is None:
            return None, None
        try:
            return key, self.cache.get(key)
        except TypeError:
            return None, None

    def store(self, key: tuple[Any, ...] | None, entry: CachedCall) -> None:
        if key is None:
            return
        if len(self.cache) > _CACHE_LIMIT:
            self.cache.clear()
        self.cache[key] = entry

    def decide(
        self,
        name: str,
        rule: Rule | None,
        mesh: DeviceMesh,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        inplace: bool = False,
        keep_layout: bool = False,
        coordinate: tuple[int, ...] | None = None,
        stacklevel: int = 4,
    ) -> tuple[Decision, bool]:
        """The decision for one call whose ``args``/``kwargs`` hold a ``TensorInfo`` (global shape,
        actual placements) per DTensor; True with it when no rule exists and inputs are replicated.

        Rules assume equal shards on every rank: an unevenly sharded input is shown to them in its
        nearest even layout and moved to it before the op -- except where a pointwise rule may run
        shard by shard on the uneven layout itself, a rule's ``uneven_rule`` keeps it (reductions
        over unsharded dims), or ``keep_layout`` (in-place updates, which
        keep the layout they find) says to show the real one."""
        actual_call = OpCall(name, mesh.shape, args, kwargs, coordinate)
        actual = [t.placements for t in actual_call.tensors()]
        if keep_layout:
            call, shown = actual_call, actual
        else:
            def even(x: Any) -> Any:
                if isinstance(x, TensorInfo):
                    return dataclasses.replace(x, placements=even_placements(x.shape, mesh.shape, x.placements))
                return x

            call = OpCall(name, mesh.shape, map_leaves(even, args), map_leaves(even, kwargs), coordinate)
            shown = [t.placements for t in call.tensors()]
            n_pointwise = int(getattr(rule, "uneven_pointwise", 0) or 0)
            if shown != actual and n_pointwise:
                kept = uneven_pointwise_rule(actual_call, n_outputs=n_pointwise, inplace=inplace)
                if kept is not None:
                    return dataclasses.replace(kept, kernel=getattr(rule, "uneven_kernel", None)), False
            uneven_rule = getattr(rule, "uneven_rule", None)
            if shown != actual and uneven_rule is not None:
                kept = uneven_rule(actual_call)
                if kept is not None:
                    return kept, False
        if rule is None:
            label = self._fallback_label(name)
            if name not in self.warned:
                self.warned.add(name)
                warnings.warn(
                    f"DTensor: no sharding rule for {label}; replicating its inputs (correct but slow)",
                    stacklevel=stacklevel,
                )
            rep = tuple(Replicate() for _ in mesh.shape)
            return Decision(tuple(rep for _ in actual), (rep,)), True
        decision = rule(call)
        if shown != actual:  # inputs the rule leaves alone still move to the even layout it saw
            ins = tuple(s if d is None and s != a else d for d, s, a in zip(decision.inputs, shown, actual))
            decision = dataclasses.replace(decision, inputs=ins + tuple(decision.inputs[len(ins):]))
        return decision, False
