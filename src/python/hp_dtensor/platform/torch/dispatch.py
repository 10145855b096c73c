"""Op dispatch for torch DTensors: aten op -> sharding rule -> local op.

Decisions are cached per (op, input specs, other arguments), so the steady state of an op is a
dictionary look-up, the input redistributions the decision asks for, the local op and the wrap.
An op without a rule replicates its inputs (correct, slower) and warns once naming the op.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.placement_types import Partial, Replicate
from hp_dtensor.platform.torch import loss_parallel as _loss_parallel
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec
from hp_dtensor.platform.torch.random_ops import RANDOM_OPS, run_random
from hp_dtensor.platform.torch.redistribute import redistribute_local
from hp_dtensor.shard_geometry import even_placements, global_shape, is_even
from hp_dtensor.sharding.op_call import Decision, OpCall, OpTable, Rule, TensorInfo, map_leaves
from hp_dtensor.sharding.uneven import uneven_pointwise_rule

aten = torch.ops.aten

_TABLE = OpTable()
RULES = _TABLE.rules
KERNELS = _TABLE.kernels
# (decision, is_fallback, global output shapes or None where the wrap may infer them from even shards)
_cache: dict[Any, tuple[Decision, bool, list[tuple[int, ...]] | None]] = {}
_warned: set[str] = set()
_CACHE_LIMIT = 16384


register = _TABLE.register
kernel = _TABLE.kernel


FOREACH_RULES: dict[str, Rule] = {}  # by base op name ("add", "mul", ...), "*" for the rest


def _find_rule(func: Any) -> Rule | None:
    rule = RULES.get(func)
    if rule is None:
        rule = RULES.get(func.overloadpacket)
    if rule is None and func._schema.name.startswith("aten::_foreach_"):
        base = func._schema.name[len("aten::_foreach_") :].rstrip("_")
        rule = FOREACH_RULES.get(base, FOREACH_RULES.get("*"))
    return rule


def _fallback_rule(call: OpCall) -> Decision:
    rep = tuple(Replicate() for _ in call.mesh_shape)
    return Decision(tuple(rep for _ in call.tensors()), (rep,))


_inplace_cache: dict[Any, bool] = {}


def _is_inplace(func: Any) -> bool:
    r = _inplace_cache.get(func)
    if r is None:
        schema = func._schema
        args = schema.arguments
        r = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
        _inplace_cache[func] = r
    return r


_CONTAINERS = (list, tuple, dict)


class _SimpleSpec:
    """Args and kwargs nested at most one level in lists/tuples (what aten ops take): flatten and
    unflatten without pytree's generic (and slower) machinery.  ``shape`` holds, per argument,
    None for a leaf or (type, length) for a list/tuple of leaves."""

    __slots__ = ("arg_shape", "keys", "kw_shape", "key")

    def __init__(self, arg_shape: tuple[Any, ...], keys: tuple[str, ...], kw_shape: tuple[Any, ...]) -> None:
        self.arg_shape = arg_shape
        self.keys = keys
        self.kw_shape = kw_shape
        # The structure goes into the decision cache key: sum(x, [0, 1]) and sum(x, 0, 1) flatten
        # to the same leaves.
        self.key = (arg_shape, keys, kw_shape)

    @staticmethod
    def _take(flat: list[Any], pos: int, shape: tuple[Any, ...]) -> tuple[list[Any], int]:
        out = []
        for item in shape:
            if item is None:
                out.append(flat[pos])
                pos += 1
            else:
                typ, n = item
                out.append(typ(flat[pos : pos + n]))
                pos += n
        return out, pos

    def unflatten(self, flat: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, pos = self._take(flat, 0, self.arg_shape)
        kwargs, _ = self._take(flat, pos, self.kw_shape)
        return tuple(args), dict(zip(self.keys, kwargs))


def _flatten_values(values: Any, flat: list[Any]) -> tuple[Any, ...] | None:
    shape: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            if type(v) not in (list, tuple) or any(isinstance(x, _CONTAINERS) for x in v):
                return None
            flat.extend(v)
            shape.append((type(v), len(v)))
        elif isinstance(v, dict):
            return None
        else:
            flat.append(v)
            shape.append(None)
    return tuple(shape)


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    flat: list[Any] = []
    arg_shape = _flatten_values(args, flat)
    kw_shape = _flatten_values(kwargs.values(), flat) if arg_shape is not None else None
    if arg_shape is None or kw_shape is None:
        return pytree.tree_flatten((args, kwargs))
    return flat, _SimpleSpec(arg_shape, tuple(kwargs), kw_shape)


def _unflatten(flat: list[Any], spec: Any) -> Any:
    if isinstance(spec, _SimpleSpec):
        return spec.unflatten(flat)
    return pytree.tree_unflatten(flat, spec)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func._schema.name.startswith("aten::_foreach_"):
        return _dispatch_foreach(func, args, kwargs)
    if _loss_parallel.enabled():
        kernel_call = _loss_parallel.override(func, args, kwargs)
        if kernel_call is not None:
            return kernel_call()
    if func in RANDOM_OPS and args and isinstance(args[0], DTensor):
        return run_random(func, args, kwargs)
    return _dispatch_one(func, args, kwargs)


def _dispatch_one(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat, treespec = _flatten(args, kwargs)
    mesh = None
    has_plain = False
    # The key is structural (the argument tree) and type-exact (True, 1 and 1.0 are equal and hash
    # alike in Python but ask for different things: keepdim=True is not dim=1).
    key_parts: list[Any] = [func, treespec.key if type(treespec) is _SimpleSpec else treespec]
    for leaf in flat:
        if isinstance(leaf, DTensor):
            spec = leaf._spec
            if mesh is None:
                mesh = spec.mesh
            elif spec.mesh is not mesh and spec.mesh != mesh:
                raise ValueError(f"{func}: DTensor arguments live on different meshes ({mesh} and {spec.mesh})")
            key_parts.append(spec)
        elif isinstance(leaf, torch.Tensor):
            if leaf.ndim != 0 and not _in_backward() and not _is_one_hot_classes(func, args, leaf):
                raise RuntimeError(
                    f"{func}: got a mix of torch.Tensor (shape {tuple(leaf.shape)}) and DTensor arguments; "
                    f"make the tensor a DTensor with DTensor.from_local or distribute_tensor first"
                )
            if leaf.ndim:
                has_plain = True
                key_parts.append(("plain", tuple(leaf.shape)))
            else:
                key_parts.append("scalar-tensor")
        else:
            cls = leaf.__class__
            if cls is int:
                key_parts.append(leaf)
            elif cls is float and _is_pointwise(func):
                # A pointwise rule looks at which operands are numbers, never at their values, so
                # one decision serves every value (an optimizer's step sizes change every step).
                key_parts.append(float)
            else:
                key_parts.append((cls, leaf))
    assert mesh is not None
    if has_plain:
        flat = _as_dtensors(flat, mesh)
    key: Any = tuple(key_parts)
    try:
        cached = _cache.get(key)
    except TypeError:  # an unhashable argument: decide every time
        key, cached = None, None
    if cached is None:
        cached = _decide(func, flat, treespec, mesh)
        if key is not None:
            if len(_cache) > _CACHE_LIMIT:
                _cache.clear()
            _cache[key] = cached
    decision, is_fallback, out_shapes = cached
    return _run(func, flat, treespec, mesh, decision, is_fallback, args, out_shapes)


def _is_one_hot_classes(func: Any, args: tuple[Any, ...], leaf: torch.Tensor) -> bool:
    """``F.one_hot`` on a tensor subclass decomposes into ``x.unsqueeze(-1) == arange(classes)``
    with a plain 1-D ``arange`` the same on every rank: that one comparison takes it as Replicate."""
    return (
        func is aten.eq.Tensor
        and leaf.ndim == 1
        and args[1] is leaf
        and isinstance(args[0], DTensor)
        and args[0]._spec.shape[-1:] == (1,)
    )


def _in_backward() -> bool:
    """True while autograd runs a backward pass: zero gradients it materializes for unused outputs
    (split, unbind, ...) are plain tensors of the global shape, treated as Replicate."""
    return bool(torch._C._current_graph_task_id() != -1)


def _as_dtensors(flat: list[Any], mesh: Any) -> list[Any]:
    rep = tuple(Replicate() for _ in mesh.shape)
    return [
        DTensor(leaf, DTensorSpec(mesh, rep, tuple(leaf.shape)))
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.ndim
        else leaf
        for leaf in flat
    ]


def _decide(
    func: Any, flat: list[Any], treespec: Any, mesh: Any
) -> tuple[Decision, bool, list[tuple[int, ...]] | None]:
    decision, is_fallback = _decide_placements(func, flat, treespec, mesh)
    if not any(decision.outputs):  # a Python value (equal, item): no shape to wrap
        return decision, is_fallback, None
    return decision, is_fallback, _output_shapes(func, flat, treespec, mesh)


def _output_shapes(func: Any, flat: list[Any], treespec: Any, mesh: Any) -> list[tuple[int, ...]] | None:
    """Global output shapes, from the op run once on meta tensors of the global shapes (cached with
    the decision): with an uneven shard, in or out, local shapes differ by rank and cannot be
    scaled up.  None where meta cannot run the op (data-dependent outputs, Python values) and
    every input is even: the wrap then scales local shapes up."""
    metas = [
        torch.empty(leaf._spec.shape, dtype=leaf.dtype, device="meta")
        if isinstance(leaf, DTensor)
        else leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf
        for leaf in flat
    ]
    m_args, m_kwargs = _unflatten(metas, treespec)
    try:
        with torch.no_grad():
            out = func(*m_args, **m_kwargs)
    except Exception as e:  # no meta kernel, or data-dependent: refuse rather than guess
        if all(
            is_even(leaf._spec.shape, mesh.shape, leaf._spec.placements)
            for leaf in flat
            if isinstance(leaf, DTensor)
        ):
            return None
        raise NotImplementedError(
            f"{func} on unevenly sharded inputs: cannot infer its global output shape ({e}); "
            f"redistribute the inputs to an even layout (or Replicate) first"
        ) from e
    return [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _decide_placements(func: Any, flat: list[Any], treespec: Any, mesh: Any) -> tuple[Decision, bool]:
    # Rules assume equal shards on every rank: an unevenly sharded input is shown to them in its
    # nearest even layout (uneven Shards replicated) and redistributed to it before the op.
    infos = [
        TensorInfo(leaf._spec.shape, even_placements(leaf._spec.shape, mesh.shape, leaf._spec.placements))
        if isinstance(leaf, DTensor) else leaf for leaf in flat
    ]
    args, kwargs = _unflatten(infos, treespec)
    call = OpCall(str(func), mesh.shape, tuple(args), dict(kwargs), mesh.get_coordinate())
    rule = _find_rule(func)
    if rule is None:
        if str(func) not in _warned:
            _warned.add(str(func))
            warnings.warn(
                f"DTensor: no sharding rule for {func}; replicating its inputs (correct but slow)",
                stacklevel=3,
            )
        return _fallback_rule(call), True
    shown = [i.placements for i in infos if isinstance(i, TensorInfo)]
    actual = [leaf._spec.placements for leaf in flat if isinstance(leaf, DTensor)]
    n_pointwise: int = getattr(rule, "uneven_pointwise", None) or 0  # set on pointwise rules
    if shown != actual and n_pointwise:
        real = [TensorInfo(x._spec.shape, x._spec.placements) if isinstance(x, DTensor) else x for x in flat]
        r_args, r_kwargs = _unflatten(real, treespec)
        inplace = str(func).split(".")[1].endswith("_")
        kept = uneven_pointwise_rule(
            OpCall(str(func), mesh.shape, tuple(r_args), dict(r_kwargs), mesh.get_coordinate()),
            n_outputs=n_pointwise,
            inplace=inplace,
        )
        if kept is not None:
            return kept, False
    decision = rule(call)
    if shown != actual:  # inputs the rule leaves alone still move to the even layout it saw
        ins = tuple(s if d is None and s != a else d for d, s, a in zip(decision.inputs, shown, actual))
        ins += decision.inputs[len(ins) :]
        decision = dataclasses.replace(decision, inputs=ins)
    return decision, False


def _run(
    func: Any,
    flat: list[Any],
    treespec: Any,
    mesh: Any,
    decision: Decision,
    is_fallback: bool,
    args: Any,
    out_shapes: list[tuple[int, ...]] | None = None,
) -> Any:
    inplace = _is_inplace(func)
    locals_: list[Any] = []
    dt_locals_list: list[torch.Tensor] = []
    i = 0
    self_redistributed = False
    for leaf in flat:
        if isinstance(leaf, DTensor):
            spec = leaf._spec
            target = decision.inputs[i]
            local = leaf._local_tensor
            if target is not None and target != spec.placements:
                # A redistributed shard is fresh data laid out however the collective left it (an
                # all_gather on a later dim gives a strided view), while composite ops chose views
                # and kernels from the wrapper's strides: hand the local op a contiguous tensor.
                local = redistribute_local(local, mesh, spec.shape, spec.placements, target).contiguous()
                if i == 0 and inplace:
                    self_redistributed = True
            locals_.append(local)
            dt_locals_list.append(local)
            i += 1
        else:
            locals_.append(leaf)
    local_args, local_kwargs = _unflatten(locals_, treespec)
    if decision.args is not None or decision.kwargs is not None:
        # Rewritten arguments keep TensorInfo placeholders where the (redistributed) locals go.
        dt_locals = iter(dt_locals_list)

        def fill(x: Any) -> Any:
            return next(dt_locals) if isinstance(x, TensorInfo) else x

        if decision.args is not None:
            local_args = map_leaves(fill, decision.args)
        else:
            for _ in (x for x in pytree.tree_leaves(args) if isinstance(x, DTensor)):
                next(dt_locals)
        if decision.kwargs is not None:
            local_kwargs = map_leaves(fill, decision.kwargs)
    if decision.kernel is not None:
        out = KERNELS[decision.kernel](mesh, decision, func, *local_args, **local_kwargs)
    else:
        out = func(*local_args, **local_kwargs)
    if inplace:
        self_dt = args[0]
        if isinstance(self_dt, (list, tuple)):
            self_dt = self_dt[0]
        if self_redistributed:
            if not is_fallback:
                raise RuntimeError(f"{func}: in-place op would need to redistribute its self argument")
            spec = self_dt._spec
            rep = decision.inputs[0]
            assert rep is not None
            new_local = redistribute_local(out, mesh, spec.shape, rep, spec.placements)
            self_dt._local_tensor.copy_(new_local)
        return self_dt
    return _wrap(out, mesh, decision, out_shapes)


def _wrap(out: Any, mesh: Any, decision: Decision, out_shapes: list[tuple[int, ...]] | None = None) -> Any:
    if isinstance(out, torch.Tensor) and decision.outputs and decision.outputs[0] is not None:
        pl = decision.outputs[0]
        shape = out_shapes[0] if out_shapes else global_shape(out.shape, mesh.shape, pl)
        return DTensor(out, DTensorSpec(mesh, pl, shape))
    flat, spec = pytree.tree_flatten(out)
    res = []
    j = 0
    ti = 0  # index among tensor outputs (what out_shapes lists)
    outs = decision.outputs
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            leaf_pl = outs[min(j, len(outs) - 1)] if outs else None
            j += 1
            ti += 1
            if leaf_pl is None:
                res.append(leaf)
                continue
            shape = out_shapes[ti - 1] if out_shapes else global_shape(leaf.shape, mesh.shape, leaf_pl)
            res.append(DTensor(leaf, DTensorSpec(mesh, leaf_pl, shape)))
        else:
            if leaf is None:
                j += 1
            res.append(leaf)
    return pytree.tree_unflatten(res, spec)


_pointwise_funcs: dict[Any, bool] = {}


def _is_pointwise(func: Any) -> bool:
    known = _pointwise_funcs.get(func)
    if known is None:
        known = _pointwise_funcs[func] = bool(getattr(_find_rule(func), "uneven_pointwise", None))
    return known


def _foreach_locally(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> tuple[bool, Any]:
    """A pointwise foreach op whose list entries at each position are DTensors of one layout with
    no Partial (what an optimizer step passes) runs as one local foreach call on the shards: the
    rule would keep every layout and move nothing.  (False, None) when it does not apply."""
    if kwargs or not _is_pointwise(func) or _loss_parallel.enabled():
        return False, None
    lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == n]
    specs: list[DTensorSpec] = []
    for i in range(n):
        spec = None
        for lst in lists:
            x = lst[i]
            if isinstance(x, DTensor):
                if spec is None:
                    spec = x._spec
                elif x._spec != spec:
                    return False, None
            elif not isinstance(x, (int, float)):  # a plain tensor in a list: let the rules decide
                return False, None
        if spec is None or any(isinstance(p, Partial) for p in spec.placements):
            return False, None
        specs.append(spec)
    local_args = tuple(
        [x._local_tensor if isinstance(x, DTensor) else x for x in a]
        if isinstance(a, (list, tuple)) and len(a) == n else a
        for a in args
    )
    if any(isinstance(a, DTensor) for a in local_args):  # a DTensor scalar operand: use the rules
        return False, None
    out = func(*local_args)
    if _is_inplace(func) or out is None:
        return True, None
    return True, [DTensor(o, spec) for o, spec in zip(out, specs)]


def _dispatch_foreach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Foreach ops run as one local call when every entry keeps its layout, else element by
    element through the same rules (one list entry at a time)."""
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    done, result = _foreach_locally(func, args, kwargs, n)
    if done:
        return result
    results: list[Any] = []
    for i in range(n):
        sub = tuple([a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args)
        results.append(_dispatch_one(func, sub, kwargs))
    if _is_inplace(func) or results[0] is None:
        return None
    return [r[0] for r in results]

