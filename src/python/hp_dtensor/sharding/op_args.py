"""Reading an op's arguments from an ``OpCall``: where each backend's calling convention puts them.

aten ops take ``(self, dim, keepdim, ...)`` positionally or by keyword, and name their in-place
overloads with a trailing ``_`` (``aten.add_.Tensor``); a MindSpore primitive call arrives as
``(prim, name, [inputs...])``.  Rules and the backends' op tables read arguments through these
functions, so a rule sees plain values (a list of dims, a bool) and no convention.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor.sharding.op_call import OpCall


def dims_of(v: Any) -> list[int] | None:
    """A ``dim`` argument (an int, a sequence of ints, or None for every dim) as a list or None."""
    if v is None:
        return None
    return [v] if isinstance(v, int) else list(v)


def dims_arg(call: OpCall, pos: int) -> list[int] | None:
    """The reduced dims at position ``pos`` or keyword ``dim`` (None: every dim)."""
    return dims_of(call.args[pos] if len(call.args) > pos else call.kwargs.get("dim"))


def keepdim_arg(call: OpCall, pos: int) -> bool:
    """``keepdim`` at position ``pos`` or by keyword (default False)."""
    return bool(call.args[pos]) if len(call.args) > pos else bool(call.kwargs.get("keepdim", False))


def int_arg(call: OpCall, pos: int, name: str, default: int) -> int:
    """An int argument at position ``pos`` or keyword ``name``."""
    return int(call.args[pos] if len(call.args) > pos else call.kwargs.get(name, default))


def float_arg(call: OpCall, pos: int, name: str, default: float) -> float:
    """A float argument at position ``pos`` or keyword ``name``."""
    return float(call.args[pos] if len(call.args) > pos else call.kwargs.get(name, default))


def inplace_by_name(call: OpCall) -> bool:
    """An aten overload named ``aten.<op>_.<overload>`` writes its first argument."""
    return call.name.split(".")[1].endswith("_")


def prim_inputs(call: OpCall) -> tuple[Any, ...]:
    """The inputs of a primitive call ``(prim, name, [inputs])``, or the args themselves."""
    if len(call.args) == 3 and isinstance(call.args[1], str) and isinstance(call.args[2], (list, tuple)):
        return tuple(call.args[2])
    return call.args


def with_inputs(call: OpCall, inputs: tuple[Any, ...]) -> OpCall:
    """``call`` with ``inputs`` as its positional arguments (what a rule on them should see)."""
    return OpCall(call.name, call.mesh_shape, inputs, call.kwargs)


def reduce_args(call: OpCall) -> tuple[Any, list[int] | None, bool]:
    """(input, reduced dims or None for all, keepdim) of a reduction in any of its forms: the
    functional ``(x, dim, keepdim[, dtype])`` (SumExt, ReduceMax from ``ops.amax``) or the
    primitive call ``(prim, name, [x, axis, keep_dims[, skip_mode]])`` (``ops.ReduceSum()``, what
    ``ops.norm`` uses), where an empty axis means every dim."""
    inputs = prim_inputs(call)
    x = inputs[0]
    axis = inputs[1] if len(inputs) > 1 else call.kwargs.get("dim", call.kwargs.get("axis"))
    keep = inputs[2] if len(inputs) > 2 else call.kwargs.get("keepdim", call.kwargs.get("keep_dims", False))
    dims = dims_of(axis)
    if inputs is not call.args and len(inputs) > 3 and inputs[3] is True and not dims:
        raise NotImplementedError(f"{call.name}(skip_mode=True) over no axis on a DTensor is not supported")
    return x, dims, bool(keep)
