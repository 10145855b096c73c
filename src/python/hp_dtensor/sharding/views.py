"""View-like ops: the shard follows the data when the sharded dim stays contiguous.

``view``/``reshape`` split and merge dims in groups; a shard survives on the group's outermost
dim (which maps to the outermost output dim of the group when that one is divisible by the mesh
size).  Other shards are gathered first.  Local calls get local sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hp_dtensor.layout.shard_geometry import local_shape
from hp_dtensor.placement_types import Placement, Replicate, Shard
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo
from hp_dtensor.sharding.pointwise import pointwise_rule


def infer_size(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs (src dims, dst dims) whose products match, in order; size-1 dims stand alone."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        ins, outs = [i], [j]
        pin, pout = src[i], dst[j]
        i += 1
        j += 1
        while pin != pout:
            if pin < pout:
                pin *= src[i]
                ins.append(i)
                i += 1
            else:
                pout *= dst[j]
                outs.append(j)
                j += 1
        groups.append((ins, outs))
    return groups


def reshape_placements(
    src_shape: Sequence[int], dst_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(required input placements, output placements) for reshaping ``src_shape`` to ``dst_shape``."""
    groups = view_groups(src_shape, dst_shape)
    req: list[Placement] = []
    out: list[Placement] = []
    for k, p in enumerate(placements):
        if isinstance(p, Shard):
            g = next(g for g in groups if p.dim in g[0])
            ins, outs = g
            if outs and p.dim == ins[0] and dst_shape[outs[0]] % mesh_shape[k] == 0 and src_shape[p.dim] % mesh_shape[
                k
            ] == 0 and not any(
                isinstance(q, Shard) and q.dim == p.dim for q in placements[:k]
            ):
                req.append(p)
                out.append(Shard(outs[0]))
                continue
            req.append(Replicate())
            out.append(Replicate())
        else:
            req.append(p)
            out.append(p)
    return tuple(req), tuple(out)


def view_rule(call: OpCall, size_arg: int = 1) -> Decision:
    """``view(self, size)``/``reshape``/``_unsafe_view``: sizes rewritten to the local shape."""
    t: TensorInfo = call.args[0]
    dst = infer_size(call.args[size_arg], t.numel)
    req, out = reshape_placements(t.shape, dst, t.placements, call.mesh_shape)
    args = list(call.args)
    args[size_arg] = list(local_shape(dst, call.mesh_shape, out, call.coordinate))
    return Decision((req,), (out,), args=tuple(args))


def permute_rule(call: OpCall, dims: Sequence[int]) -> Decision:
    t: TensorInfo = call.args[0]
    dims = [d % t.ndim for d in dims] if t.ndim else []
    out = tuple(Shard(dims.index(p.dim)) if isinstance(p, Shard) else p for p in t.placements)
    return Decision((t.placements,), (out,))


def transpose_rule(call: OpCall) -> Decision:
    t: TensorInfo = call.args[0]
    if t.ndim < 2:
        return Decision((t.placements,), (t.placements,))
    d0 = call.args[1] % t.ndim if len(call.args) > 1 else 0
    d1 = call.args[2] % t.ndim if len(call.args) > 2 else 1
    perm = list(range(t.ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute_rule(call, perm)


def unsqueeze_rule(call: OpCall) -> Decision:
    t: TensorInfo = call.args[0]
    d = call.args[1] % (t.ndim + 1)
    out = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= d else p for p in t.placements)
    return Decision((t.placements,), (out,))


def squeeze_rule(call: OpCall) -> Decision:
    t: TensorInfo = call.args[0]
    if len(call.args) > 1:
        dims_arg = call.args[1]
        dims = [dims_arg] if isinstance(dims_arg, int) else list(dims_arg)
        dims = [d % max(t.ndim, 1) for d in dims if t.shape[d % max(t.ndim, 1)] == 1]
    else:
        dims = [i for i, s in enumerate(t.shape) if s == 1]
    out = tuple(
        Shard(p.dim - sum(d < p.dim for d in dims)) if isinstance(p, Shard) else p for p in t.placements
    )
    return Decision((t.placements,), (out,))


def expand_rule(call: OpCall) -> Decision:
    """``expand(self, size)``: sharded dims keep their size (expanding them is not possible)."""
    t: TensorInfo = call.args[0]
    size = list(call.args[1])
    lead = len(size) - t.ndim
    glob = [t.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    req: list[Placement] = []
    out: list[Placement] = []
    for p in t.placements:
        if isinstance(p, Shard) and t.shape[p.dim] == glob[p.dim + lead]:
            req.append(p)
            out.append(Shard(p.dim + lead))
        elif isinstance(p, Shard):
            req.append(Replicate())
            out.append(Replicate())
        else:
            req.append(p)
            out.append(p)
    args = list(call.args)
    args[1] = list(local_shape(glob, call.mesh_shape, out, call.coordinate))
    return Decision((tuple(req),), (tuple(out),), args=tuple(args))


def dim_preserving_rule(call: OpCall, dims: Sequence[int], n_outputs: int = 1) -> Decision:
    """Ops that need ``dims`` whole (slice/select/split along them, softmax over them): shards on
    those dims are gathered, others flow through.  ``select`` removes its dim (caller adjusts)."""
    t: TensorInfo = call.args[0]
    norm = {d % max(t.ndim, 1) for d in dims}
    req = tuple(Replicate() if isinstance(p, Shard) and p.dim in norm else p for p in t.placements)
    return Decision((req,), tuple(req for _ in range(n_outputs)))


def select_rule(call: OpCall) -> Decision:
    t: TensorInfo = call.args[0]
    d = call.args[1] % t.ndim
    req = tuple(Replicate() if isinstance(p, Shard) and p.dim == d else p for p in t.placements)
    out = tuple(Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > d else p for p in req)
    return Decision((req,), (out,))


def cat_rule(call: OpCall) -> Decision:
    """``cat(tensors, dim)``: the cat dim is gathered; all inputs agree on the other shards."""
    tensors: list[TensorInfo] = list(call.args[0])
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    ref = next(t for t in tensors if t.ndim > 0)
    dim %= ref.ndim
    req = tuple(
        Replicate() if (isinstance(p, Shard) and p.dim == dim) or not isinstance(p, (Shard, Replicate)) else p
        for p in ref.placements
    )
    return Decision(tuple(req for _ in tensors), (req,))


def split_rule(call: OpCall, dim: int, unbind: bool = False) -> Decision:
    """``split``/``split_with_sizes``/``unbind`` along ``dim``: that dim is gathered, other shards
    flow through; ``unbind`` removes the dim, so shards after it move down by one."""
    t: TensorInfo = call.args[0]
    dec = dim_preserving_rule(call, [dim])
    if not unbind:
        return dec
    d = dim % t.ndim
    req = dec.inputs[0]
    assert req is not None
    out = tuple(Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > d else p for p in req)
    return Decision(dec.inputs, (out,))


def slice_rule(call: OpCall, dim: int, start: int | None, end: int | None, step: int) -> Decision:
    """``x[start:end:step]`` along ``dim``: the full slice is a no-op view that keeps every layout;
    any other gathers that dim."""
    t: TensorInfo = call.args[0]
    d = dim % t.ndim
    if (start in (None, 0)) and (end is None or end >= t.shape[d]) and step == 1:
        return Decision((t.placements,), (t.placements,))
    return dim_preserving_rule(call, [dim])


def stack_rule(call: OpCall, tensors: Sequence[TensorInfo], axis: int) -> Decision:
    """``stack(tensors, axis)``: placements agree as for a pointwise op over the (equal-shaped)
    inputs, linear in all of them jointly; a shard dim at or after ``axis`` moves up by one."""
    axis %= tensors[0].ndim + 1
    dec = pointwise_rule(OpCall(call.name, call.mesh_shape, tuple(tensors)), linearity="add")
    out = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= axis else p for p in dec.outputs[0] or ())
    return Decision(dec.inputs, (out,))


# ---------------------------------------------------------------- ops as the backends call them
def local_view_rule(call: OpCall) -> Decision:
    """``view``/``reshape`` run as the ``view`` kernel (a copy where the shard's layout cannot take
    the view) with local sizes; with nothing sharded the op runs exactly as asked."""
    dec = view_rule(call)
    if not any(isinstance(p, Shard) for pl in (*dec.inputs, *dec.outputs) for p in pl or ()):
        # Every shard is the whole tensor laid out as the wrapper says (and the steady state
        # needs no rewritten arguments).
        return Decision(dec.inputs, dec.outputs)
    return Decision(dec.inputs, dec.outputs, args=dec.args, kernel="view")


def squeeze_dims_rule(call: OpCall) -> Decision:
    """Squeeze exactly the dims of global size 1 (the ``squeeze_dims`` kernel): a shard may have
    size 1 where the tensor does not."""
    dec = squeeze_rule(call)
    t: TensorInfo = call.args[0]
    if len(call.args) > 1:
        d = call.args[1]
        asked = [d] if isinstance(d, int) else list(d)
        dims = [x % max(t.ndim, 1) for x in asked if t.ndim and t.shape[x % t.ndim] == 1]
    else:
        dims = [i for i, s in enumerate(t.shape) if s == 1]
    return Decision(dec.inputs, dec.outputs, args=(t, dims), kernel="squeeze_dims")


def select_backward_rule(call: OpCall) -> Decision:
    """``select_backward(grad, input_sizes, dim, index)``: zeros with ``grad`` written at the index;
    the grad's shards move past the restored dim, the local call gets local sizes."""
    g: TensorInfo = call.args[0]
    sizes = list(call.args[1])
    d = call.args[2] % len(sizes)
    out = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= d else p for p in g.placements)
    args = list(call.args)
    args[1] = list(local_shape(tuple(sizes), call.mesh_shape, out, call.coordinate))
    return Decision((g.placements,), (out,), args=tuple(args))


def reshape_sizes_rule(call: OpCall) -> Decision:
    """``Reshape(x, sizes)`` / ``View(x, *sizes)``: the sizes as one sequence or spread out; the
    local call gets local sizes as a tuple."""
    x = call.args[0]
    rest = call.args[1:]
    sizes = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    dec = view_rule(OpCall(call.name, call.mesh_shape, (x, sizes)))
    if dec.args is None:
        return Decision(dec.inputs, dec.outputs, args=(x, tuple(sizes)))
    return Decision(dec.inputs, dec.outputs, args=(dec.args[0], tuple(dec.args[1])))


def stack_axis_rule(call: OpCall) -> Decision:
    """``stack(tensors, axis)`` (axis positional or ``dim``/``axis``), run as the platform's
    ``stack`` kernel (MindSpore's CPU backend has no StackExt kernel)."""
    axis = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", call.kwargs.get("axis", 0))
    dec = stack_rule(call, list(call.args[0]), int(axis))
    return Decision(dec.inputs, dec.outputs, kernel="stack")


def concat_axis_rule(call: OpCall) -> Decision:
    """``Concat(tensors, axis)``: ``cat_rule`` with the axis positional or by keyword ``axis``."""
    axis = call.args[1] if len(call.args) > 1 else call.kwargs.get("axis", 0)
    return cat_rule(OpCall(call.name, call.mesh_shape, (list(call.args[0]), axis)))


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("view _unsafe_view reshape", local_view_rule)
ATEN_OPS.add("t transpose.int", transpose_rule)
ATEN_OPS.add("permute", lambda c: permute_rule(c, c.args[1]))
ATEN_OPS.add("unsqueeze", unsqueeze_rule)
ATEN_OPS.add("squeeze squeeze.dim squeeze.dims", squeeze_dims_rule)
ATEN_OPS.add("select_backward", select_backward_rule)
ATEN_OPS.add("expand", expand_rule)
ATEN_OPS.add("select.int", select_rule)
ATEN_OPS.add("cat", cat_rule)
ATEN_OPS.add(
    "split.Tensor split_with_sizes", lambda c: split_rule(c, c.args[2] if len(c.args) > 2 else c.kwargs.get("dim", 0))
)
ATEN_OPS.add("unbind.int", lambda c: split_rule(c, c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0), True))
ATEN_OPS.add("slice.Tensor", lambda c: slice_rule(
    c,
    c.args[1] if len(c.args) > 1 else 0,
    c.args[2] if len(c.args) > 2 else None,
    c.args[3] if len(c.args) > 3 else None,
    c.args[4] if len(c.args) > 4 else 1,
))
ATEN_OPS.add(
    "stack", lambda c: stack_rule(c, list(c.args[0]), c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0))
)

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("Reshape View", reshape_sizes_rule)
MINDSPORE_OPS.add("TransposeExtView TransposeExt Swapaxes", transpose_rule)
MINDSPORE_OPS.add("Transpose TransposeView", lambda c: permute_rule(c, list(c.args[1])))
MINDSPORE_OPS.add("ExpandDims Unsqueeze", unsqueeze_rule)
MINDSPORE_OPS.add("Stack StackExt", stack_axis_rule)
MINDSPORE_OPS.add("Concat", concat_axis_rule)
