"""Ops that act along one dim (scans, sorts, flips) and ops that index by a tensor
(``index_select``/``gather`` and their scatter-add duals).

Along-dim ops need the dim whole: a shard there is gathered, shards on other dims flow.  A
``Partial`` flows through the linear ones (cumsum, flip) and is reduced for the rest (sort, topk).

Indexing ops flow a shard on a dim the index does not address when the index is sharded the
same way there (positions along that dim are local in both).  An index sharded along the
addressed dim picks global positions from a whole source, so its shard moves to the output
(``gather``, ``index_select``) or, in the scatter-add duals, every rank adds its part into zeros
and the output is ``Partial("sum")``.  Selecting commutes with every reduce op, so a ``Partial``
source flows through a selection with a replicated index.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import int_arg
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo

_R = Replicate()


def _linear_partial(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("sum", "avg")


def along_dims_rule(call: OpCall, dims: Sequence[int], *, linear: bool, n_outputs: int = 1) -> Decision:
    """The op mixes values along ``dims`` only (``cumsum``, ``flip``, ``sort``, ``topk``)."""
    t: TensorInfo = call.args[0]
    nd = max(t.ndim, 1)
    along = {d % nd for d in dims}
    req = tuple(
        _R
        if (isinstance(p, Shard) and p.dim in along) or (isinstance(p, Partial) and not (linear and _linear_partial(p)))
        else p
        for p in t.placements
    )
    outs = [req] + [tuple(_R if isinstance(p, Partial) else p for p in req)] * (n_outputs - 1)
    return Decision((req,), tuple(outs))


def slice_backward_rule(call: OpCall) -> Decision:
    """``slice_backward(grad, input_sizes, dim, start, end, step)``: zeros of ``input_sizes`` with
    ``grad`` written at the slice; the local call gets the local sizes."""
    g: TensorInfo = call.args[0]
    sizes = list(call.args[1])
    d = call.args[2] % len(sizes)
    req = tuple(_R if isinstance(p, Shard) and p.dim == d else p for p in g.placements)
    args = list(call.args)
    args[1] = _local_sizes(sizes, req, call.mesh_shape, call.coordinate)
    return Decision((req,), (req,), args=tuple(args))


def _local_sizes(
    sizes: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int] | None
) -> list[int]:
    from hp_dtensor.layout.shard_geometry import local_shape

    return list(local_shape(tuple(sizes), mesh_shape, placements, coord))


def index_select_rule(call: OpCall) -> Decision:
    """``index_select(self, dim, index)`` with a 1-D index."""
    t: TensorInfo = call.args[0]
    idx: TensorInfo = call.args[2]
    d = call.args[1] % max(t.ndim, 1)
    req_t: list[Placement] = []
    req_i: list[Placement] = []
    out: list[Placement] = []
    for p, q in zip(t.placements, idx.placements):
        if (isinstance(p, Shard) and p.dim != d) or isinstance(p, Partial):
            req_t.append(p)
            req_i.append(_R)
            out.append(p)
        elif isinstance(q, Shard):
            req_t.append(_R)
            req_i.append(q)
            out.append(Shard(d))
        else:
            req_t.append(_R)
            req_i.append(_R)
            out.append(_R)
    return Decision((tuple(req_t), tuple(req_i)), (tuple(out),))


def gather_rule(call: OpCall) -> Decision:
    """``gather(self, dim, index)``: output has the index's shape."""
    t: TensorInfo = call.args[0]
    idx: TensorInfo = call.args[2]
    d = call.args[1] % max(t.ndim, 1)
    req_t: list[Placement] = []
    req_i: list[Placement] = []
    out: list[Placement] = []
    for p, q in zip(t.placements, idx.placements):
        aligned_t = isinstance(p, Shard) and p.dim != d and idx.shape[p.dim] == t.shape[p.dim]
        aligned_i = isinstance(q, Shard) and q.dim != d and idx.shape[q.dim] == t.shape[q.dim]
        if aligned_t:  # shard both on the self's dim
            assert isinstance(p, Shard)
            req_t.append(p)
            req_i.append(p)
            out.append(p)
        elif isinstance(p, Partial):
            req_t.append(p)
            req_i.append(_R)
            out.append(p)
        elif aligned_i:
            assert isinstance(q, Shard)
            req_t.append(q)
            req_i.append(q)
            out.append(q)
        elif isinstance(q, Shard) and q.dim == d:
            req_t.append(_R)
            req_i.append(q)
            out.append(q)
        else:
            req_t.append(_R)
            req_i.append(_R)
            out.append(_R)
    return Decision((tuple(req_t), tuple(req_i)), (tuple(out),))


def scatter_rule(call: OpCall, *, accumulate: bool, src_is_tensor: bool, index_1d: bool) -> Decision:
    """``scatter_add``/``scatter``/``index_add`` (self, dim, index, src_or_value, ...).

    ``accumulate``: the op adds ``src`` into ``self`` (then an index and src sharded along ``dim``
    give a Partial("sum") out of a self that is Partial("sum") too: zeros on every rank but one).
    ``index_1d``: ``index_add``'s index addresses ``dim`` only; src's ``dim`` follows it."""
    t: TensorInfo = call.args[0]
    idx: TensorInfo = call.args[2]
    src: TensorInfo | None = call.args[3] if src_is_tensor else None
    d = call.args[1] % max(t.ndim, 1)
    req_t: list[Placement] = []
    req_i: list[Placement] = []
    req_s: list[Placement] = []
    out: list[Placement] = []
    for k, p in enumerate(t.placements):
        q = idx.placements[k]
        s = src.placements[k] if src is not None else _R

        def aligned(pl: Placement) -> bool:
            if not (isinstance(pl, Shard) and pl.dim != d):
                return False
            if src is not None and src.shape[pl.dim] != t.shape[pl.dim]:
                return False
            return index_1d or idx.shape[pl.dim] == t.shape[pl.dim]

        shard = p if aligned(p) else s if aligned(s) else q if not index_1d and aligned(q) else None
        if shard is not None:
            assert isinstance(shard, Shard)
            req_t.append(shard)
            req_i.append(_R if index_1d else shard)
            req_s.append(shard)
            out.append(shard)
            continue
        along = s if index_1d else q
        if accumulate and src is not None and isinstance(along, Shard) and along.dim == d and (
            isinstance(p, Replicate) or p == Partial("sum")
        ):
            req_t.append(Partial("sum"))
            req_i.append(Shard(0) if index_1d else Shard(d))
            req_s.append(Shard(d))
            out.append(Partial("sum"))
            continue
        lin = p if _linear_partial(p) else s if _linear_partial(s) else None
        if src is not None and lin is not None:  # linear in (self, src) jointly
            req_t.append(lin)
            req_i.append(_R)
            req_s.append(lin)
            out.append(lin)
            continue
        req_t.append(_R)
        req_i.append(_R)
        req_s.append(_R)
        out.append(_R)
    ins: list[tuple[Placement, ...]] = [tuple(req_t), tuple(req_i)]
    if src is not None:
        ins.append(tuple(req_s))
    return Decision(tuple(ins), (tuple(out),))


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add(
    "cumsum logcumsumexp",
    lambda c: along_dims_rule(c, [int_arg(c, 1, "dim", 0)], linear=c.name.startswith("aten.cumsum")),
)
ATEN_OPS.add("cumprod cummax cummin", lambda c: along_dims_rule(
    c, [int_arg(c, 1, "dim", 0)], linear=False, n_outputs=1 if c.name.startswith("aten.cumprod") else 2
))
ATEN_OPS.add("flip", lambda c: along_dims_rule(c, list(c.args[1]), linear=True))
ATEN_OPS.add("roll", lambda c: along_dims_rule(
    c, list(c.args[2]) if len(c.args) > 2 and len(c.args[2]) else list(range(c.args[0].ndim)), linear=True
))
ATEN_OPS.add("sort", lambda c: along_dims_rule(c, [int_arg(c, 1, "dim", -1)], linear=False, n_outputs=2))
ATEN_OPS.add("sort.stable", lambda c: along_dims_rule(c, [int_arg(c, 2, "dim", -1)], linear=False, n_outputs=2))
ATEN_OPS.add("topk", lambda c: along_dims_rule(c, [int_arg(c, 2, "dim", -1)], linear=False, n_outputs=2))
ATEN_OPS.add("slice_backward", slice_backward_rule)
ATEN_OPS.add("index_select", index_select_rule)
ATEN_OPS.add("gather", gather_rule)
ATEN_OPS.add(
    "scatter_add scatter_add_", lambda c: scatter_rule(c, accumulate=True, src_is_tensor=True, index_1d=False)
)
ATEN_OPS.add("index_add index_add_", lambda c: scatter_rule(c, accumulate=True, src_is_tensor=True, index_1d=True))
ATEN_OPS.add(
    "scatter.src scatter_.src", lambda c: scatter_rule(c, accumulate=False, src_is_tensor=True, index_1d=False)
)
ATEN_OPS.add(
    "scatter.value scatter_.value", lambda c: scatter_rule(c, accumulate=False, src_is_tensor=False, index_1d=False)
)
