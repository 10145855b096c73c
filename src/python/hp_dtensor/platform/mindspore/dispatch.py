"""Op dispatch for MindSpore DTensors: op name -> sharding rule -> local op.

MindSpore hands every op that has a DTensor argument to ``DTensor.__fallback__`` with the op
(``func.name`` is e.g. ``"MatMul"``) and its arguments.  As on torch, a decision is cached per
(op, input specs, other arguments); the inputs are redistributed as it asks (differentiably), the
op runs on local data with fallback off, and tensor outputs are wrapped with the placements the
rule gave.  Because autograd runs on local tensors, a replicated input whose op gives ranks
different outputs holds only this rank's term of its gradient: a parameter or op output gets
``AllReduceGrad`` (its gradient must be whole), a value made by ``redistribute`` lets its
``GradLayout`` collect the terms once in its own backward (``hp_dtensor.sharding.local_grads``).
An op without a rule replicates its inputs (correct, slower) and warns once naming the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import Tensor
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.platform.mindspore.dtensor import DTensor
from hp_dtensor.platform.mindspore.redistribute import AllReduceGrad, KeepGradOnRoot, Redistribute, ScaleGrad
from hp_dtensor.sharding.dispatch import (
    CachedCall,
    DispatchCore,
    call_key,
    fill_placeholders,
    flatten_prim_args,
    make_cached_call,
    shared_mesh,
    unflatten_one_level,
    wrap_leaves,
)
from hp_dtensor.sharding.local_grads import GradFacts, GradLayout, grad_facts
from hp_dtensor.sharding.local_updates import LOCAL_UPDATE_OPS, is_one_element, join_local_updates
from hp_dtensor.sharding.op_call import Kernels, OpCall, TensorInfo
from hp_dtensor.sharding.op_tables import MINDSPORE_RULES

KERNELS = Kernels()  # the local kernels some rules name (``kernels.py``)
kernel = KERNELS.register
_CORE = DispatchCore(lambda name: f"MindSpore op {name}")
_warned = _CORE.warned

# Random ops run whole through a handler ``(func, args, kwargs) -> result`` (see ``random_ops.py``):
# their values come from the job-wide stream, not from a local kernel, so no rule applies.
RANDOM_OPS: dict[str, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {}


def random_op(*names: str) -> Callable[[Any], Any]:
    def deco(handler: Any) -> Any:
        for n in names:
            RANDOM_OPS[n] = handler
        return handler

    return deco


def _flatten(args: tuple[Any, ...]) -> tuple[list[Any], tuple[Any, ...]]:
    return flatten_prim_args(args, DTensor)


def _unflatten(flat: list[Any], shape: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(unflatten_one_level(flat, 0, shape)[0])


def _tensor_key(x: Any) -> Any:
    """A plain tensor in a key (only one-element tensors get past the mixing check): its shape."""
    return tuple(Tensor.shape.fget(x))


_shape = _tensor_key


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    name = str(func.name)
    handler = RANDOM_OPS.get(name)
    if handler is not None:
        return handler(func, args, kwargs)
    flat, shape = _flatten(args)
    if name in LOCAL_UPDATE_OPS:
        flat = join_local_updates(name, flat, DTensor, Tensor, _shape)
    kw_items = list(kwargs.items())
    update = name in LOCAL_UPDATE_OPS
    mesh, _ = shared_mesh(
        name, flat + [v for _, v in kw_items], DTensor, Tensor, "mindspore.Tensor", _shape,
        lambda _, lshape: update and is_one_element(lshape),
    )
    key, entry = _CORE.lookup(
        call_key(name, _unflatten(flat, shape), dict(kw_items), DTensor, Tensor, _tensor_key, False)
    )
    if entry is None:
        entry = _decide(name, flat, shape, kw_items, mesh)
        _CORE.store(key, entry)
    return _run(func, flat, shape, kw_items, mesh, entry)


def _info(leaf: Any) -> Any:
    return TensorInfo(leaf._spec.shape, leaf._spec.placements, str(leaf.dtype)) if isinstance(leaf, DTensor) else leaf


def _decide(name: str, flat: list[Any], shape: tuple[Any, ...], kw_items: list[tuple[str, Any]], mesh: Any) -> CachedCall:
    args = _unflatten([_info(x) for x in flat], shape)
    kwargs = {k: _info(v) for k, v in kw_items}
    # In-place updates keep the layout they find, uneven or not.
    decision, is_fallback = _CORE.decide(
        name, MINDSPORE_RULES.get(name), mesh, args, kwargs, keep_layout=name in LOCAL_UPDATE_OPS,
        coordinate=mesh.get_coordinate(), stacklevel=5,
    )
    call = OpCall(name, mesh.shape, args, kwargs)
    actual = [t.placements for t in call.tensors()]
    # The autograd bookkeeping below runs on every call: no direct steady state on MindSpore.
    return make_cached_call(
        decision, is_fallback, mesh, actual, None, single_tensor_output=False, top_level_only=False,
        inplace=False, extra=grad_facts(call, decision),
    )


def _run(func: Any, flat: list[Any], shape: tuple[Any, ...], kw_items: list[tuple[str, Any]], mesh: Any,
         entry: CachedCall) -> Any:
    decision = entry.decision
    prep: GradFacts = entry.extra
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
                missing, extra = layout.adapt(dims)
                if missing:
                    local = AllReduceGrad.apply(local, mesh, missing)
                if extra:
                    local = KeepGradOnRoot.apply(local, mesh, extra)
            elif dims:
                local = AllReduceGrad.apply(local, mesh, dims)
            if prep.grad_scale[i] != 1.0 and leaf.is_floating_point():
                local = ScaleGrad.apply(local, prep.grad_scale[i])
            locals_.append(local)
            dt_locals.append(local)
            i += 1
        else:
            locals_.append(leaf)
    n_flat = len(flat)
    local_args = _unflatten(locals_[:n_flat], shape)
    local_kwargs = {k: v for (k, _), v in zip(kw_items, locals_[n_flat:])}
    if decision.args is not None or decision.kwargs is not None:
        n_in_args = sum(isinstance(x, DTensor) for x in flat)
        local_args, local_kwargs = fill_placeholders(decision, dt_locals, n_in_args, local_args, local_kwargs)
    with NoFallbackGuard():
        if decision.kernel is not None:
            out = KERNELS[decision.kernel](mesh, decision, *local_args, **local_kwargs)
        else:
            out = func(*local_args, **local_kwargs)
    result = _wrap(out, mesh, entry)
    if passed_layout is not None:
        for r in result if isinstance(result, (list, tuple)) else (result,):
            if isinstance(r, DTensor):
                r._grad_layout = passed_layout
    return result


def _wrap(out: Any, mesh: Any, entry: CachedCall) -> Any:
    """Tensor outputs as DTensors with the placements the decision gave (``wrap_leaves``: an
    output of a list or tuple takes the decision's output at its position, the last repeating)."""
    if isinstance(out, Tensor):
        spec = entry.output_spec(0, 0, mesh, tuple(Tensor.shape.fget(out)))
        return out if spec is None else DTensor(out, spec)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_leaves(out, mesh, entry, Tensor, _shape, DTensor))
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
