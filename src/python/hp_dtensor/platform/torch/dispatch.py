"""Op dispatch for torch DTensors: aten op -> sharding rule -> local op.

Decisions are cached per (op, input specs, other arguments), so the steady state of an op is a
dictionary look-up, the input redistributions the decision asks for, the local op and the wrap.
An op without a rule replicates its inputs (correct, slower) and warns once naming the op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.layout.shard_geometry import is_even
from hp_dtensor.placement_types import Replicate
from hp_dtensor.platform.torch.dtensor import DTensor, DTensorSpec
from hp_dtensor.platform.torch.random_ops import run_random
from hp_dtensor.platform.torch.redistribute import redistribute_local
from hp_dtensor.sharding.dispatch import (
    CachedCall,
    DispatchCore,
    OneLevelSpec,
    call_key,
    fill_placeholders,
    flatten_call,
    holds_dtensor,
    make_cached_call,
    shared_mesh,
    wrap_leaves,
)
from hp_dtensor.sharding.foreach import foreach_rule, list_length, local_foreach_args, one_entry_calls
from hp_dtensor.sharding.interceptors import INTERCEPTORS, intercepting
from hp_dtensor.sharding.interceptors import OpInterceptor as OpInterceptor  # re-exported
from hp_dtensor.sharding.interceptors import pop_interceptor as pop_interceptor  # re-exported
from hp_dtensor.sharding.interceptors import push_interceptor as push_interceptor  # re-exported
from hp_dtensor.sharding.op_call import Kernels, Rule, TensorInfo
from hp_dtensor.sharding.op_tables import ATEN_RULES
from hp_dtensor.sharding.random_ops import ATEN_RANDOM_OPS
from hp_dtensor.sharding.strides import global_strides

aten = torch.ops.aten

KERNELS = Kernels()  # the local kernels some rules name (``kernels.py``)
kernel = KERNELS.register
_CORE = DispatchCore(str)
_warned = _CORE.warned  # ops that fell back to replication (tests read it)
_cache_get = _CORE.cache.get

# Features built on the DTensor (loss parallel in hp_tp) take over some ops while a context of
# theirs is active (``hp_dtensor.sharding.interceptors``).
_make_wrapper = torch.Tensor._make_wrapper_subclass
_NO_KEY = object()


def _find_rule(func: Any) -> Rule | None:
    """The rule ``hp_dtensor.sharding`` lists for the op's name (``aten.mm.default``); a foreach
    op takes its base op's (``foreach_rule``)."""
    rule = ATEN_RULES.get(str(func))
    if rule is None and func._schema.name.startswith("aten::_foreach_"):
        base = func._schema.name[len("aten::_foreach_") :].rstrip("_")
        rule = foreach_rule(base)
    return rule


_inplace_cache: dict[Any, bool] = {}


def _is_inplace(func: Any) -> bool:
    r = _inplace_cache.get(func)
    if r is None:
        schema = func._schema
        args = schema.arguments
        r = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
        _inplace_cache[func] = r
    return r


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    return flatten_call(args, kwargs) or pytree.tree_flatten((args, kwargs))


def _unflatten(flat: list[Any], spec: Any) -> Any:
    if isinstance(spec, OneLevelSpec):
        return spec.unflatten(flat)
    return pytree.tree_unflatten(flat, spec)


_VF = torch._C._VariableFunctions
# Overloads whose generated Python binding, given the same arguments, resolves to the same overload
# (a Python number next to a tensor binds to the ``.Tensor`` overload as a wrapped number, as the
# dispatcher passed it): the binding parses arguments about a microsecond faster than the
# overload's schema-driven call, which is most of what a direct call costs beyond the kernel.
_BINDINGS: dict[Any, Any] = {
    aten.add.Tensor: _VF.add, aten.sub.Tensor: _VF.sub, aten.mul.Tensor: _VF.mul, aten.div.Tensor: _VF.div,
    aten.mm.default: _VF.mm, aten.bmm.default: _VF.bmm, aten.addmm.default: _VF.addmm, aten.t.default: _VF.t,
    aten.transpose.int: _VF.transpose, aten.unsqueeze.default: _VF.unsqueeze, aten.view.default: torch.Tensor.view,
    aten.neg.default: _VF.neg, aten.exp.default: _VF.exp, aten.relu.default: _VF.relu,
    aten.sigmoid.default: _VF.sigmoid, aten.tanh.default: _VF.tanh, aten.rsqrt.default: _VF.rsqrt,
    aten.sqrt.default: _VF.sqrt, aten.pow.Tensor_Scalar: _VF.pow, aten.silu.default: torch._C._nn.silu,
    aten.gelu.default: torch._C._nn.gelu,
}
_NORMAL, _FOREACH, _RANDOM = 0, 1, 2
# Per op: its kind, whether its rule is pointwise (numbers' values never matter to it), whether it
# writes its first argument, whether it returns exactly one tensor, and the callable to run it.
# Keyed by id: an OpOverload hashes in Python, an int in C; the facts hold the op, so its id stays
# its own for as long as the entry (and every cache key using the id) lives.
_op_facts: dict[int, tuple[int, bool, bool, bool, Any]] = {}


def _facts(func: Any) -> tuple[int, bool, bool, bool, Any]:
    facts = _op_facts.get(id(func))
    if facts is None:
        name = func._schema.name
        kind = _FOREACH if name.startswith("aten::_foreach_") else _RANDOM if str(func) in ATEN_RANDOM_OPS else _NORMAL
        returns = func._schema.returns
        one_tensor = len(returns) == 1 and str(returns[0].type) == "Tensor"
        # The C++ op behind an OpOverload: calling it skips the overload's Python __call__; for the
        # hottest ops, torch's generated Python binding (argument parsing specialised per function).
        call = _BINDINGS.get(func) or (func._op if isinstance(func, torch._ops.OpOverload) else func)
        facts = _op_facts[id(func)] = (kind, _is_pointwise(func), _is_inplace(func), one_tensor, call)
    return facts


def _plain_key(t: torch.Tensor) -> Any:
    return (tuple(t.shape), t.dtype) if t.ndim else "scalar-tensor"


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    op = id(func)
    kind, pointwise, _, _, local_op = _op_facts.get(op) or _facts(func)
    if kind == _FOREACH:
        return _dispatch_foreach(func, args, kwargs)
    stack = getattr(INTERCEPTORS, "stack", None)
    if stack is not None:
        for intercept in reversed(stack):
            kernel_call = intercept(func, args, kwargs)
            if kernel_call is not None:
                return kernel_call()
    if kind == _RANDOM and args and isinstance(args[0], DTensor):
        return run_random(func, args, kwargs)
    key = call_key(op, args, kwargs, DTensor, torch.Tensor, _plain_key, pointwise)
    try:
        entry = _cache_get(key)
    except TypeError:  # an unhashable argument: decide every time
        key = entry = None
    if entry is not None and (entry.direct or entry.direct_inplace):
        # The steady state: every DTensor stays where it is, one output of a known spec (or, in
        # place, the written argument in its own layout: a gradient accumulated into a parameter's).
        locals_ = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
        out = local_op(*locals_, **kwargs) if kwargs else local_op(*locals_)
        if entry.direct_inplace:
            return args[0]
        # Inline of _new_dtensor (this is the per-op path).
        spec: Any = entry.out_specs[0]  # type: ignore[index]
        stride = out.stride()
        strides = entry.memo.get(stride) or _strides(entry, stride, out.is_contiguous())
        r = _make_wrapper(
            DTensor, spec.shape, strides=strides, dtype=out.dtype, device=out.device, layout=out.layout,
            requires_grad=False,
        )
        r._local_tensor = out
        r._spec = spec
        return r
    return _dispatch_one(func, args, kwargs, key, entry)


def _strides(entry: CachedCall, stride: tuple[int, ...], contiguous: bool) -> tuple[int, ...]:
    """The wrapper strides of the entry's one output for a local output of ``stride``, computed
    once per entry and stride (the same as ``DTensor(out, spec)`` gives)."""
    spec = entry.out_specs[0]  # type: ignore[index]
    assert spec is not None
    strides = entry.memo[stride] = global_strides(stride, spec.mesh.shape, spec.placements, spec.shape, contiguous)
    return strides


def _dispatch_one(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], key: Any = _NO_KEY, entry: CachedCall | None = None
) -> Any:
    if key is _NO_KEY:
        key, entry = _CORE.lookup(call_key(id(func), args, kwargs, DTensor, torch.Tensor, _plain_key, _facts(func)[1]))
    if entry is None and _decomposes(func):
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    flat, treespec = _flatten(args, kwargs)
    mesh, has_plain = _mesh_of(func, args, flat)
    if has_plain:
        flat = _as_dtensors(flat, mesh)
    if entry is None:
        entry = _decide(func, args, kwargs, flat, treespec, mesh, has_plain)
        _CORE.store(key, entry)
    return _run(func, flat, treespec, mesh, entry, args)


def _mesh_of(func: Any, args: tuple[Any, ...], flat: list[Any]) -> tuple[Any, bool]:
    """The mesh of the call's DTensors and whether a plain tensor joins them; ``RuntimeError``
    for a plain tensor beside DTensors where it may not join them."""
    return shared_mesh(
        func, flat, DTensor, torch.Tensor, "torch.Tensor", _shape,
        lambda leaf, _: _in_backward() or _is_one_hot_classes(func, args, leaf),
    )


_decomposable: dict[int, bool] = {}


def _decomposes(func: Any) -> bool:
    """An op without a rule that torch implements by composing others (``aten.linear``,
    ``aten.flatten``...): under inference mode such ops reach DTensor dispatch undecomposed, and
    run as their parts (which have rules) instead of replicating, as in every other mode."""
    r = _decomposable.get(id(func))
    if r is None:
        r = _decomposable[id(func)] = bool(
            isinstance(func, torch._ops.OpOverload)
            and _find_rule(func) is None
            and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
            )
        )
    return r


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


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
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], treespec: Any, mesh: Any,
    has_plain: bool,
) -> CachedCall:
    infos = [TensorInfo(x._spec.shape, x._spec.placements, str(x.dtype)) if isinstance(x, DTensor) else x for x in flat]
    i_args, i_kwargs = _unflatten(infos, treespec)
    name = str(func)
    decision, is_fallback = _CORE.decide(
        name, _find_rule(func), mesh, tuple(i_args), dict(i_kwargs),
        inplace=name.split(".")[1].endswith("_"), coordinate=mesh.get_coordinate(),
    )
    # A Python value (equal, item) has no shape to wrap.
    out_shapes = _output_shapes(func, flat, treespec, mesh) if any(decision.outputs) else None
    top_level = not has_plain and not any(
        isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a)
        for a in (*args, *kwargs.values())
    )
    return make_cached_call(
        decision, is_fallback, mesh, [x._spec.placements for x in flat if isinstance(x, DTensor)], out_shapes,
        single_tensor_output=_facts(func)[3], top_level_only=top_level, inplace=_is_inplace(func),
    )


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


def _n_arg_leaves(treespec: Any) -> int:
    """How many of the flat leaves are positional arguments (the rest are keyword arguments)."""
    if isinstance(treespec, OneLevelSpec):
        return treespec.n_arg_leaves()
    return int(treespec.children_specs[0].num_leaves)


def _run(func: Any, flat: list[Any], treespec: Any, mesh: Any, entry: CachedCall, args: Any) -> Any:
    decision = entry.decision
    inplace = _is_inplace(func)
    locals_: list[Any] = []
    dt_locals: list[torch.Tensor] = []
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
            dt_locals.append(local)
            i += 1
        else:
            locals_.append(leaf)
    local_args, local_kwargs = _unflatten(locals_, treespec)
    if decision.args is not None or decision.kwargs is not None:
        n_in_args = sum(isinstance(x, DTensor) for x in flat[: _n_arg_leaves(treespec)])
        local_args, local_kwargs = fill_placeholders(decision, dt_locals, n_in_args, local_args, local_kwargs)
    if decision.kernel is not None:
        out = KERNELS[decision.kernel](mesh, decision, func, *local_args, **local_kwargs)
    else:
        out = func(*local_args, **local_kwargs)
    if inplace:
        self_dt = args[0]
        if isinstance(self_dt, (list, tuple)):
            self_dt = self_dt[0]
        if self_redistributed:
            if not entry.is_fallback:
                raise RuntimeError(f"{func}: in-place op would need to redistribute its self argument")
            spec = self_dt._spec
            rep = decision.inputs[0]
            assert rep is not None
            new_local = redistribute_local(out, mesh, spec.shape, rep, spec.placements)
            self_dt._local_tensor.copy_(new_local)
        return self_dt
    return _wrap(out, mesh, entry)


def _wrap(out: Any, mesh: Any, entry: CachedCall) -> Any:
    if isinstance(out, torch.Tensor):
        spec = entry.output_spec(0, 0, mesh, tuple(out.shape))
        return out if spec is None else DTensor(out, spec)
    flat, tree = pytree.tree_flatten(out)
    return pytree.tree_unflatten(wrap_leaves(flat, mesh, entry, torch.Tensor, _shape, DTensor), tree)


_pointwise_funcs: dict[Any, bool] = {}


def _is_pointwise(func: Any) -> bool:
    known = _pointwise_funcs.get(func)
    if known is None:
        known = _pointwise_funcs[func] = bool(getattr(_find_rule(func), "uneven_pointwise", None))
    return known


def _dispatch_foreach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Foreach ops run as one local call when every entry keeps its layout, else element by
    element through the same rules (``hp_dtensor.sharding.foreach``)."""
    n = list_length(func, args)
    local = None
    if not kwargs and _is_pointwise(func) and not intercepting():
        local = local_foreach_args(args, n, DTensor, torch.Tensor, lambda x: x._local_tensor)
    if local is not None:
        local_args, specs = local
        out = func(*local_args)
        if _is_inplace(func) or out is None:
            return None
        return [o if spec is None else DTensor(o, spec) for o, spec in zip(out, specs)]
    if any(a.name == "scalars" and str(a.type) == "Tensor" for a in func._schema.arguments):
        # one value per entry in a tensor that entry-by-entry calls cannot split (a DTensor of
        # them, or lists whose entries do not share one layout)
        raise NotImplementedError(
            f"{func}: a tensor of per-entry scalars is supported only when every list entry is a DTensor of "
            f"one layout (or a plain tensor) and the scalars tensor is plain; pass the scalars as a list of "
            f"numbers (scalars.tolist()) instead"
        )
    calls = [(sub, holds_dtensor(sub, DTensor)) for sub in one_entry_calls(args, n)]
    # An entry refused (a plain tensor beside a DTensor, two meshes) is refused before any entry
    # runs, so an in-place op that raises leaves every list as it was.
    for sub, distributed in calls:
        if distributed:
            _mesh_of(func, sub, _flatten(sub, kwargs)[0])
    results = [_dispatch_one(func, sub, kwargs) if distributed else func(*sub, **kwargs) for sub, distributed in calls]
    if _is_inplace(func) or (results and results[0] is None):
        return None
    return [r[0] for r in results]
