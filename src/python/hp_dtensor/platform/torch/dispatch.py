"""Op dispatch for torch DTensors: aten op -> sharding rule -> local op.

Decisions are cached per (op, input specs, other arguments), so the steady state of an op is a
dictionary look-up, the input redistributions the decision asks for, the local op and the wrap.
An op without a rule replicates its inputs (correct, slower) and warns once naming the op.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.placement_types import Replicate
from hp_dtensor.platform.torch import loss_parallel as _loss_parallel
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec
from hp_dtensor.platform.torch.redistribute import redistribute_local
from hp_dtensor.shard_geometry import global_shape
from hp_dtensor.sharding.op_call import Decision, OpCall, OpTable, Rule, TensorInfo, map_leaves

aten = torch.ops.aten

_TABLE = OpTable()
RULES = _TABLE.rules
KERNELS = _TABLE.kernels
_cache: dict[Any, tuple[Decision, bool]] = {}
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

    __slots__ = ("arg_shape", "keys", "kw_shape")

    def __init__(self, arg_shape: tuple[Any, ...], keys: tuple[str, ...], kw_shape: tuple[Any, ...]) -> None:
        self.arg_shape = arg_shape
        self.keys = keys
        self.kw_shape = kw_shape

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
    return _dispatch_one(func, args, kwargs)


def _dispatch_one(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat, treespec = _flatten(args, kwargs)
    mesh = None
    has_plain = False
    key_parts: list[Any] = [func]
    for leaf in flat:
        if isinstance(leaf, DTensor):
            spec = leaf._spec
            if mesh is None:
                mesh = spec.mesh
            elif spec.mesh is not mesh and spec.mesh != mesh:
                raise ValueError(f"{func}: DTensor arguments live on different meshes ({mesh} and {spec.mesh})")
            key_parts.append(spec)
        elif isinstance(leaf, torch.Tensor):
            if leaf.ndim != 0 and not _in_backward():
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
            key_parts.append(leaf)
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
    decision, is_fallback = cached
    return _run(func, flat, treespec, mesh, decision, is_fallback, args)


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


def _decide(func: Any, flat: list[Any], treespec: Any, mesh: Any) -> tuple[Decision, bool]:
    infos = [
        TensorInfo(leaf._spec.shape, leaf._spec.placements) if isinstance(leaf, DTensor) else leaf for leaf in flat
    ]
    args, kwargs = _unflatten(infos, treespec)
    call = OpCall(str(func), mesh.shape, tuple(args), dict(kwargs))
    rule = _find_rule(func)
    if rule is None:
        if str(func) not in _warned:
            _warned.add(str(func))
            warnings.warn(
                f"DTensor: no sharding rule for {func}; replicating its inputs (correct but slow)",
                stacklevel=3,
            )
        return _fallback_rule(call), True
    return rule(call), False


def _run(
    func: Any, flat: list[Any], treespec: Any, mesh: Any, decision: Decision, is_fallback: bool, args: Any
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
                local = redistribute_local(local, mesh, spec.shape, spec.placements, target)
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
        out = KERNELS[decision.kernel](mesh, decision, *local_args, **local_kwargs)
    elif func is aten.view.default and not local_args[0].is_contiguous():
        # The wrapper reports contiguous strides, so ``reshape`` of a transposed DTensor arrives
        # as ``view``; its local shard may not be viewable: reshape copies exactly when it must.
        out = local_args[0].reshape(local_args[1])
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
    return _wrap(out, mesh, decision)


def _wrap(out: Any, mesh: Any, decision: Decision) -> Any:
    if isinstance(out, torch.Tensor) and decision.outputs and decision.outputs[0] is not None:
        pl = decision.outputs[0]
        return DTensor(out, DTensorSpec(mesh, pl, global_shape(out.shape, mesh.shape, pl)))
    flat, spec = pytree.tree_flatten(out)
    res = []
    j = 0
    outs = decision.outputs
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            leaf_pl = outs[min(j, len(outs) - 1)] if outs else None
            j += 1
            if leaf_pl is None:
                res.append(leaf)
                continue
            res.append(DTensor(leaf, DTensorSpec(mesh, leaf_pl, global_shape(leaf.shape, mesh.shape, leaf_pl))))
        else:
            if leaf is None:
                j += 1
            res.append(leaf)
    return pytree.tree_unflatten(res, spec)


def _dispatch_foreach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Foreach ops run element by element through the same rules (one list entry at a time)."""
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    results: list[Any] = []
    for i in range(n):
        sub = tuple([a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args)
        results.append(_dispatch_one(func, sub, kwargs))
    if _is_inplace(func) or results[0] is None:
        return None
    return [r[0] for r in results]

