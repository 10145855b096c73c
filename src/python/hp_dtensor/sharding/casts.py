"""Dtype casts of DTensors: when a ``Partial`` input may stay ``Partial`` through the cast.

A cast applies to each rank's term, a reduction to their sum; the two commute only when the
target dtype holds every value of the source exactly.  Casting a ``Partial("sum")`` of float32
terms to float16 term by term rounds each term and then sums the rounded terms in float16: not
what one process computes (the float32 value rounded once).  So a ``Partial`` input stays
``Partial`` only through a cast that loses nothing -- to a floating (or complex) format with at
least the source's exponent and mantissa bits -- and is reduced first, in its own dtype, before
any narrowing cast (to a narrower float, an integer, bool) or when either dtype is unknown.
Both backends use this one rule, so the same program gives the same numbers on torch and
MindSpore.  (``torch.distributed.tensor`` casts each term; that loses the precision above.)
"""

from __future__ import annotations

from hp_dtensor.sharding.op_args import prim_inputs, with_inputs
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo, keeps_uneven
from hp_dtensor.sharding.pointwise import pointwise_rule

# (exponent bits, mantissa bits) of the floating formats, by their neutral names; a complex
# format is its component's.
_FLOAT_FORMATS: dict[str, tuple[int, int]] = {
    "float64": (11, 52), "double": (11, 52), "complex128": (11, 52), "cdouble": (11, 52),
    "float32": (8, 23), "float": (8, 23), "complex64": (8, 23), "cfloat": (8, 23),
    "float16": (5, 10), "half": (5, 10), "complex32": (5, 10), "chalf": (5, 10),
    "bfloat16": (8, 7),
    "float8_e4m3fn": (4, 3), "float8_e4m3fnuz": (4, 3), "float8_e5m2": (5, 2), "float8_e5m2fnuz": (5, 2),
}


def dtype_name(dtype: object) -> str:
    """The neutral name of a dtype as either framework prints it: ``torch.float16``,
    ``Float16`` and ``mindspore.float16`` are all ``float16``; ``BFloat16`` is ``bfloat16``."""
    return str(dtype).rsplit(".", 1)[-1].lower()


def float_format(dtype: object) -> tuple[int, int] | None:
    """(exponent bits, mantissa bits) of a floating or complex dtype; None for any other."""
    return _FLOAT_FORMATS.get(dtype_name(dtype)) if dtype is not None else None


def cast_keeps_partial(src: object, dst: object) -> bool:
    """Whether casting each term of a Partial sum from ``src`` to ``dst`` gives the cast of the
    sum: ``dst`` is a floating format that holds every value of ``src`` (the same dtype included)."""
    s = float_format(src)
    d = float_format(dst)
    return s is not None and d is not None and d[0] >= s[0] and d[1] >= s[1]


def cast_rule(call: OpCall, target: object | None) -> Decision:
    """A cast of ``call.args[0]`` to ``target`` (None: the same dtype): pointwise, and linear in
    a Partial input only where ``cast_keeps_partial`` holds for the input's dtype."""
    src = call.args[0]
    src_dtype = src.dtype if isinstance(src, TensorInfo) else None
    keeps = src_dtype is not None and cast_keeps_partial(src_dtype, src_dtype if target is None else target)
    return pointwise_rule(call, linearity="mul" if keeps else None)


def dtype_kwarg_cast_rule(call: OpCall) -> Decision:
    """``.to(dtype)`` / ``.half()`` / ``.float()`` (aten ``_to_copy(x, *, dtype)``): a Partial
    input stays Partial only through a cast that loses nothing; before a narrowing one it is
    reduced in its own dtype."""
    return cast_rule(call, call.kwargs.get("dtype"))


def cast_input_rule(call: OpCall) -> Decision:
    """``astype``/``ops.cast`` (``Cast(x, dtype)``, as arguments or a primitive call's inputs):
    a Partial input stays Partial only through a cast that loses nothing; before a narrowing one
    (to float16, an integer, bool) it is reduced in its own dtype, as one process would round the
    reduced value once."""
    inputs = prim_inputs(call)
    target = inputs[1] if len(inputs) > 1 else call.kwargs.get("dtype")
    return cast_rule(with_inputs(call, inputs), target)


keeps_uneven(dtype_kwarg_cast_rule)
keeps_uneven(cast_input_rule)


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("_to_copy", dtype_kwarg_cast_rule)

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("ToDtype Cast", cast_input_rule)
