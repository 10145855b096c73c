"""Foreach ops (``_foreach_add_``, what an optimizer step issues) on lists of DTensors.

When every list entry at each position is a DTensor of one layout with no ``Partial``, or every
entry at a position is a plain tensor (what an optimizer step passes), and the op is pointwise,
the rule would keep every layout and move nothing: the op runs as one local foreach call on the
shards.  Otherwise it runs element by element through the same rules, one list entry at a time
(an entry without a DTensor as a plain call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hp_dtensor.placement_types import Partial, Replicate
from hp_dtensor.sharding.op_call import Decision, OpCall, Rule
from hp_dtensor.sharding.pointwise import pointwise_family


def list_length(op: Any, args: tuple[Any, ...]) -> int:
    """The length of the op's lists; ``RuntimeError`` naming the lengths when they differ (as
    torch's foreach kernels raise: entry ``i`` of every list is one computation)."""
    lengths = [len(a) for a in args if isinstance(a, (list, tuple))]
    if len(set(lengths)) > 1:
        raise RuntimeError(
            f"{op}: its tensor lists must have the same number of entries, got lengths {lengths}; "
            f"pass one entry per tensor in every list"
        )
    return lengths[0]


def local_foreach_args(
    args: tuple[Any, ...], n: int, dtensor_type: Any, tensor_type: Any, local_of: Callable[[Any], Any]
) -> tuple[tuple[Any, ...], list[Any]] | None:
    """``(local args, the spec of each list position)`` when the call may run as one local foreach
    call, else None.  The entries at each position are DTensors of one spec without ``Partial``,
    or numbers, or (a position without a DTensor) plain tensors, whose spec is None: each position
    is a computation of its own, so a plain parameter beside sharded ones (a model parallelized in
    part) steps as it would without them.  A plain tensor beside a DTensor at one position, or a
    DTensor outside a list, goes through the rules."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == n]
    specs: list[Any] = []
    for i in range(n):
        spec = None
        plain = False
        for lst in lists:
            x = lst[i]
            if isinstance(x, dtensor_type):
                if spec is None:
                    spec = x._spec
                elif x._spec != spec:
                    return None
            elif isinstance(x, tensor_type):
                plain = True
            elif not isinstance(x, (int, float)):
                return None
        if spec is None and not plain:
            return None
        if spec is not None and (plain or any(isinstance(p, Partial) for p in spec.placements)):
            return None
        specs.append(spec)
    local_args = tuple(
        [local_of(x) if isinstance(x, dtensor_type) else x for x in a]
        if isinstance(a, (list, tuple)) and len(a) == n else a
        for a in args
    )
    if any(isinstance(a, dtensor_type) for a in local_args):  # a DTensor scalar operand
        return None
    return local_args, specs


def one_entry_calls(args: tuple[Any, ...], n: int) -> Iterator[tuple[Any, ...]]:
    """The arguments of the element-by-element calls: entry ``i`` of every list, as a list of one."""
    for i in range(n):
        yield tuple([a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args)


def gathered_rule(call: OpCall) -> Decision:
    """A foreach op that is not elementwise (``_foreach_norm``, what ``clip_grad_norm_`` issues
    with foreach=True; ``_foreach_max``, ``_foreach_powsum``, ``_foreach_mm``): each tensor
    gathered, so the local op on whole tensors is the global one, replicated (correct; these see
    gradient-sized tensors next to a step, not activations)."""
    infos = call.tensors()
    return Decision(tuple(tuple(Replicate() for _ in t.placements) for t in infos),
                    (tuple(Replicate() for _ in infos[0].placements),))


# The rule of each foreach op by its base name (``_foreach_add_`` is ``add``): the one-entry calls a
# foreach op falls back to are decided by it.  Every torch foreach op is elementwise (``*``)
# except the per-tensor reductions and products gathered here.
FOREACH_RULES: dict[str, Rule] = {
    **{base: gathered_rule for base in ("norm", "max", "powsum", "mm")},
    **{
        base: pointwise_family(linearity, scalar_once=False)
        for base, linearity in {
            "add": "add", "sub": "add", "mul": "mul", "div": "div", "copy": "add", "zero": "mul", "neg": "mul",
            "*": None,
        }.items()
    },
}


def foreach_rule(base: str) -> Rule:
    """The rule of the foreach op named ``base`` (``add`` for ``_foreach_add_``)."""
    return FOREACH_RULES.get(base, FOREACH_RULES["*"])
