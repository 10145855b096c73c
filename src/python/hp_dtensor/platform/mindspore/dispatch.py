"""Op dispatch for MindSpore DTensors: op name -> sharding rule -> local op.

MindSpore hands every op that has a DTensor argument to ``DTensor.__fallback__`` with the op
(``func.name`` is e.g. ``"MatMul"``) and its arguments.  As on torch, a decision is cached per
(op, input specs, other arguments); the inputs are redistributed as it asks (differentiably), the
op runs on local data with fallback off, and tensor outputs are wrapped with the placements the
rule gave.  Because autograd runs on local tensors, a replicated input whose op gives ranks
different outputs holds only this rank's term of its gradient: a parameter or op output gets
``AllReduceGrad`` (its gradient must be whole), a value made by ``redistribute`` lets its
``GradLayout`` collect the terms once in its own backward (see ``redistribute.py``).
An op without a rule replicates its inputs (correct, slower) and warns once naming the op.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.dtensor_spec import DTensorSpec
from hp_dtensor.placement_types import Partial, Replicate
from hp_dtensor.platform.mindspore.dtensor import DTensor
from hp_dtensor.platform.mindspore.redistribute import AllReduceGrad, GradLayout, KeepGradOnRoot, Redistribute
from hp_dtensor.shard_geometry import even_placements, global_shape
from hp_dtensor.sharding.op_call import Decision, OpCall, OpTable, TensorInfo, map_leaves
from hp_dtensor.sharding.uneven import uneven_pointwise_rule


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A decision plus what the gradient bookkeeping derives from it, per DTensor input: the mesh
    dims on which the op's local backward yields only this rank's term of the input's gradient,
    and whether the op passes the input's gradient through unchanged in form (see ``_run``)."""

    decision: Decision
    grad_dims: tuple[tuple[int, ...], ...]
    transparent: tuple[bool, ...]


_TABLE = OpTable()
RULES = _TABLE.rules
KERNELS = _TABLE.kernels
_cache: dict[Any, _Prepared] = {}
_warned: set[str] = set()
_CACHE_LIMIT = 16384

# In-place updates and fused optimizer kernels (mint.optim): a plain tensor of the DTensor's local
# shape among their arguments is that DTensor's local gradient or state -- what value_and_grad
# returns for a DTensor parameter -- so it joins with the first DTensor's spec and the op runs
# shard by shard.  Anywhere else a plain tensor next to a DTensor is an error.
LOCAL_UPDATE_OPS = frozenset({
    "AdamW", "Adam", "ApplyAdamW", "SGD", "ApplyMomentum", "Assign", "AssignAdd", "AssignSub",
    "InplaceAddExt", "InplaceAddsExt", "InplaceSubExt", "InplaceSubScalar", "InplaceMul", "InplaceMuls",
    "InplaceDiv", "InplaceDivs", "InplaceCopy", "InplaceAddcmul", "InplaceAddcdiv", "InplaceLerp",
    "InplaceSqrt", "InplaceZero", "InplaceFillScalar",
})


register = _TABLE.register
kernel = _TABLE.kernel

# Random ops run whole through a handler ``(func, args, kwargs) -> result`` (see ``random_ops.py``):
# their values come from the job-wide stream, not from a local kernel, so no rule applies.
RANDOM_OPS: dict[str, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {}


def random_op(*names: str) -> Callable[[Any], Any]:
    def deco(handler: Any) -> Any:
        for n in names:
            RANDOM_OPS[n] = handler
        return handler

    return deco


def _flatten(args: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
    """Leaves of ``args`` with lists/tuples opened one level (MindSpore ops take at most a list of
    tensors, or a primitive call ``(prim, name, [inputs])``); ``shape`` rebuilds them."""
    flat: list[Any] = []
    shape: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
            shape.append((type(a), len(a)))
        else:
            flat.append(a)
            shape.append(None)
    return flat, shape


def _unflatten(flat: list[Any], shape: list[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    pos = 0
    for item in shape:
        if item is None:
            out.append(flat[pos])
            pos += 1
        else:
            typ, n = item
            out.append(typ(flat[pos : pos + n]))
            pos += n
    return tuple(out)


def _key_of(x: Any) -> Any:
    """A cache-key part for one argument: structural and type-exact, so ``(0, 1)`` and ``0, True``,
    ``[a]`` and ``(a,)``, ``1``, ``1.0`` and ``True`` never share a decision.  A DTensor is its
    spec; a plain tensor (only one-element tensors get this far) its shape."""
    if isinstance(x, DTensor):
        return x._spec
    if isinstance(x, Tensor):
        return (Tensor, tuple(Tensor.shape.fget(x)))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_key_of(y) for y in x))
    return (type(x), x)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    name = str(func.name)
    handler = RANDOM_OPS.get(name)
    if handler is not None:
        return handler(func, args, kwargs)
    flat, shape = _flatten(args)
    if name in LOCAL_UPDATE_OPS:
        flat = _join_local_updates(name, flat)
    kw_items = list(kwargs.items())
    mesh = None
    for leaf in flat + [v for _, v in kw_items]:
        if isinstance(leaf, DTensor):
            spec = leaf._spec
            if mesh is None:
                mesh = spec.mesh
            elif spec.mesh is not mesh and spec.mesh != mesh:
                raise ValueError(f"{name}: DTensor arguments live on different meshes ({mesh} and {spec.mesh})")
        elif isinstance(leaf, Tensor):
            lshape = tuple(Tensor.shape.fget(leaf))
            if lshape and not (name in LOCAL_UPDATE_OPS and _is_one_element(lshape)):
                raise RuntimeError(
                    f"{name}: got a mix of mindspore.Tensor (shape {lshape}) and DTensor arguments; make the "
                    f"tensor a DTensor with DTensor.from_local or distribute_tensor first"
                )
    if mesh is None:
        raise NotImplementedError(
            f"{name}: a DTensor argument nested more than one list deep is not supported; pass it directly"
        )
    key: Any = (name, tuple(_key_of(x) for x in flat), tuple(shape),
                tuple((k, _key_of(v)) for k, v in kw_items))
    try:
        cached = _cache.get(key)
    except TypeError:  # an unhashable argument: decide every time
        key, cached = None, None
    if cached is None:
        cached = _decide(name, flat, shape, kw_items, mesh)
        if key is not None:
            if len(_cache) > _CACHE_LIMIT:
                _cache.clear()
            _cache[key] = cached
    return _run(func, flat, shape, kw_items, mesh, cached)


def _join_local_updates(name: str, flat: list[Any]) -> list[Any]:
    first = next((x for x in flat if isinstance(x, DTensor)), None)
    if first is None:
        return flat
    spec = first._spec
    want = spec.local_shape()
    out = []
    for x in flat:
        got = tuple(Tensor.shape.fget(x)) if isinstance(x, Tensor) else ()
        if isinstance(x, Tensor) and not isinstance(x, DTensor) and got and not _is_one_element(got):
            if got != want:
                raise RuntimeError(
                    f"{name}: a plain tensor of shape {got} updates a DTensor whose local shard is {want}; "
                    f"pass the local gradient/state (shape {want}) or a DTensor"
                )
            x = DTensor(x, spec)
        out.append(x)
    return out


def _is_one_element(shape: tuple[int, ...]) -> bool:
    """Step counters and learning rates arrive as one-element tensors: scalars, not shards."""
    return all(s == 1 for s in shape)


# The in-place updates that commute with a Partial reduction when applied to each rank's term:
# scaling by a number, zeroing, copying a value of the same layout.  Any other (adding a number,
# filling, sqrt, ...) would act once per rank.
_PARTIAL_SAFE_UPDATES = frozenset({"InplaceMuls", "InplaceDivs", "InplaceZero", "InplaceCopy", "Assign"})


@register(*LOCAL_UPDATE_OPS)
def _local_update(call: OpCall) -> Decision:
    """Every argument is already in the layout of the tensor it updates: run shard by shard."""
    tensors = call.tensors()
    first = tensors[0]
    if any(isinstance(p, Partial) for p in first.placements) and (
        call.name not in _PARTIAL_SAFE_UPDATES or any(t.placements != first.placements for t in tensors[1:])
    ):
        raise ValueError(
            f"in-place {call.name} on a DTensor with placements {first.placements} would apply to every "
            f"rank's partial term; call .redistribute(placements=[Replicate()]) (or .full_tensor()) first"
        )
    return Decision(tuple(None for _ in tensors), (first.placements,), out_shape=first.shape)


def _info(leaf: Any) -> Any:
    return TensorInfo(leaf._spec.shape, leaf._spec.placements) if isinstance(leaf, DTensor) else leaf


def _even_info(leaf: Any, mesh: Any) -> Any:
    """A DTensor as rules that assume equal shards see it: uneven ``Shard``s read as Replicate."""
    if not isinstance(leaf, DTensor):
        return leaf
    spec = leaf._spec
    return TensorInfo(spec.shape, even_placements(spec.shape, mesh.shape, spec.placements))


def _decide(name: str, flat: list[Any], shape: list[Any], kw_items: list[tuple[str, Any]], mesh: Any) -> _Prepared:
    rule = RULES.get(name)
    actual = [x._spec.placements for x in flat + [v for _, v in kw_items] if isinstance(x, DTensor)]
    if name in LOCAL_UPDATE_OPS:  # updates keep the layout they find, uneven or not
        shown = actual
        infos, kw_infos = [_info(x) for x in flat], {k: _info(v) for k, v in kw_items}
    else:
        # Rules assume equal shards on every rank: an unevenly sharded input is shown to them in its
        # nearest even layout and redistributed to it before the op -- except where a pointwise
        # op can run shard by shard on the uneven layout itself.
        infos, kw_infos = [_even_info(x, mesh) for x in flat], {k: _even_info(v, mesh) for k, v in kw_items}
        shown = [t.placements for t in infos + list(kw_infos.values()) if isinstance(t, TensorInfo)]
        n_pointwise = int(getattr(rule, "uneven_pointwise", 0) or 0)
        if shown != actual and n_pointwise:
            real = OpCall(name, mesh.shape, _unflatten([_info(x) for x in flat], shape),
                          {k: _info(v) for k, v in kw_items})
            kept = uneven_pointwise_rule(real, n_outputs=n_pointwise)
            if kept is not None:
                kept = dataclasses.replace(kept, kernel=getattr(rule, "uneven_kernel", None))
                return _prepare(real, kept)
    call = OpCall(name, mesh.shape, _unflatten(infos, shape), kw_infos)
    if rule is None:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"DTensor: no sharding rule for MindSpore op {name}; replicating its inputs (correct but slow)",
                stacklevel=4,
            )
        rep = tuple(Replicate() for _ in mesh.shape)
        decision = Decision(tuple(rep for _ in call.tensors()), (rep,))
    else:
        decision = rule(call)
    if shown != actual:  # inputs the rule leaves alone still move to the even layout it saw
        ins = tuple(s if d is None and s != a else d for d, s, a in zip(decision.inputs, shown, actual))
        decision = dataclasses.replace(decision, inputs=ins + tuple(decision.inputs[len(ins):]))
    return _prepare(call, decision)


def _prepare(call: OpCall, decision: Decision) -> _Prepared:
    reqs = [target if target is not None else t.placements for t, target in zip(call.tensors(), decision.inputs)]
    grad_dims = tuple(_grad_sum_dims(req, decision.outputs) for req in reqs)
    single = len(reqs) == 1
    transparent = tuple(
        single and not dims and _replicated_where_input_is(req, decision.outputs) for req, dims in zip(reqs, grad_dims)
    )
    return _Prepared(decision, grad_dims, transparent)


def _grad_sum_dims(req: tuple[Any, ...], outputs: tuple[Any, ...]) -> tuple[int, ...]:
    """Mesh dims where ``req`` is Replicate but some output differs between ranks."""
    return tuple(
        k for k, p in enumerate(req)
        if isinstance(p, Replicate) and any(o is not None and not isinstance(o[k], Replicate) for o in outputs)
    )


def _replicated_where_input_is(req: tuple[Any, ...], outputs: tuple[Any, ...]) -> bool:
    """Every output is replicated wherever the (only) input is: every rank computes the same thing,
    so the op passes a gradient through in whatever form it comes (whole or as terms)."""
    return all(
        o is None or all(isinstance(o[k], Replicate) for k, p in enumerate(req) if isinstance(p, Replicate))
        for o in outputs
    )


def _run(func: Any, flat: list[Any], shape: list[Any], kw_items: list[tuple[str, Any]], mesh: Any,
         prep: _Prepared) -> Any:
    decision = prep.decision
    leaves = flat + [v for _, v in kw_items]
    locals_: list[Any] = []
    dt_locals: list[Any] = []
    passed_layout: GradLayout | None = None
    i = 0
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            spec = leaf._spec
            target = decision.inputs[i]
            dims = prep.grad_dims[i] if leaf.is_floating_point() else ()
            local: Any = leaf
            layout = leaf._grad_layout
            if target is not None and target != spec.placements:
                # The redistribution's backward collects the terms itself (e.g. reduce_scatter).
                local = Redistribute.apply(leaf._whole_grad_use(leaf), mesh, spec.shape, spec.placements, target,
                                           GradLayout(dims))
            elif layout is not None and prep.transparent[i]:
                passed_layout = layout
            elif layout is not None:
                if layout.partial is None:
                    layout.partial = dims
                missing = tuple(k for k in dims if k not in layout.partial)
                extra = tuple(k for k in layout.partial if k not in dims)
                if missing:
                    local = AllReduceGrad.apply(local, mesh, missing)
                if extra:
                    local = KeepGradOnRoot.apply(local, mesh, extra)
            elif dims:
                local = AllReduceGrad.apply(local, mesh, dims)
            locals_.append(local)
            dt_locals.append(local)
            i += 1
        else:
            locals_.append(leaf)
    n_flat = len(flat)
    local_args = _unflatten(locals_[:n_flat], shape)
    local_kwargs = {k: v for (k, _), v in zip(kw_items, locals_[n_flat:])}
    if decision.args is not None or decision.kwargs is not None:
        # Rewritten arguments hold TensorInfo placeholders where the (redistributed) locals go.
        it = iter(dt_locals)

        def fill(x: Any) -> Any:
            return next(it) if isinstance(x, TensorInfo) else x

        if decision.args is not None:
            local_args = map_leaves(fill, decision.args)
        else:
            for _ in range(sum(isinstance(x, DTensor) for x in flat)):
                next(it)
        if decision.kwargs is not None:
            local_kwargs = map_leaves(fill, decision.kwargs)
    with NoFallbackGuard():
        if decision.kernel is not None:
            out = KERNELS[decision.kernel](mesh, decision, *local_args, **local_kwargs)
        else:
            out = func(*local_args, **local_kwargs)
    result = _wrap(out, mesh, decision)
    if passed_layout is not None:
        for r in result if isinstance(result, (list, tuple)) else (result,):
            if isinstance(r, DTensor):
                r._grad_layout = passed_layout
    return result


def _wrap_one(out: Tensor, mesh: Any, pl: Any, gshape: tuple[int, ...] | None) -> Any:
    """``out`` as a DTensor with placements ``pl``: of global shape ``gshape`` where the rule gave one
    (uneven shards), else the shape whose even sharding gives ``out``'s local shape."""
    if pl is None:
        return out
    if gshape is None:
        gshape = global_shape(tuple(Tensor.shape.fget(out)), mesh.shape, pl)
    return DTensor(out, DTensorSpec(mesh, pl, gshape))


def _wrap(out: Any, mesh: Any, decision: Decision) -> Any:
    outs = decision.outputs
    gshape = decision.out_shape
    if isinstance(out, Tensor):
        return _wrap_one(out, mesh, outs[0] if outs else None, gshape)
    if isinstance(out, (list, tuple)):
        res = []
        j = 0
        for leaf in out:
            if isinstance(leaf, Tensor):
                res.append(_wrap_one(leaf, mesh, outs[min(j, len(outs) - 1)] if outs else None, gshape))
            else:
                res.append(leaf)
            j += 1
        return type(out)(res)
    return out


# ---------------------------------------------------------------- where MindSpore skips __fallback__
class _ListPrimitiveCall:
    """A primitive whose tensors come as one list, called the way ``dispatch`` calls an op."""

    def __init__(self, prim: Any, call: Any) -> None:
        self.prim = prim
        self.call = call
        self.name = prim.name

    def __call__(self, tensors: Any, *_attrs: Any) -> Any:
        return self.call(self.prim, tensors)


def _route_list_primitive(cls: Any, attr: str | None) -> None:
    """MindSpore runs primitives that take a list of tensors (``ops.stack``, ``ops.addn``) without
    consulting ``__fallback__``, so a list of DTensors would silently compute on local shards and
    return a plain tensor.  Their ``__call__`` sends a list holding a DTensor to ``dispatch``
    (with the primitive's attribute, e.g. Stack's axis, as a second argument)."""
    if getattr(cls.__call__, "_hp_routed", False):
        return
    original = cls.__call__

    def __call__(self: Any, *args: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and any(isinstance(t, DTensor) for t in args[0]):
            extra = (self.attrs[attr],) if attr is not None else ()
            return dispatch(_ListPrimitiveCall(self, original), (list(args[0]),) + extra, {})
        return original(self, *args)

    __call__._hp_routed = True  # type: ignore[attr-defined]
    cls.__call__ = __call__


class _PlainTensorFallback:
    """``Tensor.__fallback__``, visible on the plain ``Tensor`` class only.

    A Tensor *method* called on a plain tensor with a DTensor argument (``plain.add(dt)``,
    ``plain.matmul(dt)``, ``plain ** dt``) makes MindSpore look for ``__fallback__`` on the plain
    tensor's class, which has none, and fail with an internal message.  This hook sends such a
    call to ``dispatch``, which gives the library's mixing error (or joins a one-element tensor as
    a replicated scalar).  Every subclass -- ``Parameter`` above all -- sees no attribute (the
    lookup raises ``AttributeError``), so MindSpore keeps running their ops natively: a hook
    inherited by ``Parameter`` would put every parameter op in a training step through Python."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if (owner if owner is not None else type(obj)) is not Tensor:
            raise AttributeError("__fallback__")
        return _plain_fallback


def _plain_fallback(func: Any, args: Any = (), kwargs: Any = None) -> Any:
    args, kwargs = tuple(args), dict(kwargs or {})
    flat, _ = _flatten(args)
    if any(isinstance(x, DTensor) for x in flat + list(kwargs.values())):
        return dispatch(func, args, kwargs)
    with NoFallbackGuard():  # no DTensor after all: the op as MindSpore would run it
        return func(*args, **kwargs)


def install_interceptors() -> None:
    """Close the paths by which an op on DTensors would bypass ``dispatch`` (idempotent)."""
    from mindspore.ops import operations as P

    _route_list_primitive(P.Stack, "axis")
    _route_list_primitive(P.AddN, None)
    if not isinstance(Tensor.__dict__.get("__fallback__"), _PlainTensorFallback):
        Tensor.__fallback__ = _PlainTensorFallback()
