"""Embedding lookup with a sharded table.

* table ``Shard(1)`` (embedding dim, ColwiseParallel): each rank looks up its columns; the output
  is sharded on its last dim.
* table ``Shard(0)`` (vocab, RowwiseParallel): each rank looks up the ids in its row range and
  writes zeros elsewhere (the ``masked_embedding`` kernel); the output is ``Partial("sum")``.
  Its backward (``masked_embedding_backward``) scatters only the rank's own rows.
* indices may be sharded on any dim when the table is replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_dtensor.layout.shard_geometry import local_offset
from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import prim_inputs, with_inputs
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo, replicated_rule


def embedding_rule(call: OpCall) -> Decision:
    """embedding(weight, indices, ...)."""
    weight: TensorInfo = call.args[0]
    idx: TensorInfo = call.args[1]
    out_ndim = idx.ndim + 1
    req_w: list[Placement] = []
    req_i: list[Placement] = []
    out: list[Placement] = []
    kernel = None
    for k, p in enumerate(weight.placements):
        ip = idx.placements[k]
        if isinstance(p, Shard) and p.dim == 1:
            req_w.append(p)
            req_i.append(Replicate())
            out.append(Shard(out_ndim - 1))
        elif isinstance(p, Shard) and p.dim == 0:
            req_w.append(p)
            req_i.append(Replicate())
            out.append(Partial("sum"))
            kernel = "masked_embedding"
        else:
            req_w.append(Replicate())
            keep = isinstance(ip, Shard)
            req_i.append(ip if keep else Replicate())
            out.append(ip if keep else Replicate())
    if kernel is None:
        return Decision((tuple(req_w), tuple(req_i)), (tuple(out),))
    if sum(isinstance(p, Shard) and p.dim == 0 for p in weight.placements) > 1:
        raise NotImplementedError("a vocab-sharded embedding table on more than one mesh dim is not supported")
    # The kernel gets the vocab size: a rank's first row is its chunk's offset (``vocab_start``).
    return Decision((tuple(req_w), tuple(req_i)), (tuple(out),), kwargs={**call.kwargs, "vocab": weight.shape[0]},
                    kernel=kernel)


def vocab_start(
    vocab: int, weight_placements: Sequence[Placement], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> int:
    """The first vocab row of this rank's table shard (``masked_embedding``): the offset of its
    chunk of the ``Shard(0)`` mesh dim, uneven chunks included."""
    rows_pl = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in weight_placements]
    return local_offset((vocab,), mesh_shape, rows_pl, coordinate)[0]


def embedding_backward_rule(call: OpCall, weight_placements: tuple[Placement, ...]) -> Decision:
    """embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad).

    ``weight_placements`` is the table's forward placement, recovered from the grad's shape: the
    caller passes Shard(1) when the grad is sharded on its last dim, else the rule decides."""
    grad: TensorInfo = call.args[0]
    idx: TensorInfo = call.args[1]
    req_g: list[Placement] = []
    req_i: list[Placement] = []
    out: list[Placement] = []
    for k, gp in enumerate(grad.placements):
        ip = idx.placements[k]
        if isinstance(gp, Shard) and gp.dim == grad.ndim - 1:
            req_g.append(gp)
            req_i.append(Replicate())
            out.append(Shard(1))
        elif isinstance(gp, Shard) and isinstance(ip, Shard) and gp.dim == ip.dim:
            req_g.append(gp)
            req_i.append(ip)
            out.append(Partial("sum"))
        elif isinstance(gp, Partial):
            req_g.append(gp)
            req_i.append(Replicate())
            out.append(gp)
        else:
            req_g.append(Replicate())
            req_i.append(Replicate())
            out.append(Replicate())
    return Decision((tuple(req_g), tuple(req_i)), (tuple(out),))


def gather_rows_rule(call: OpCall) -> Decision:
    """``Gather(table, ids, axis=0, batch_dims=0)``: an embedding lookup when axis is 0 and the
    table is 2-D; any other gather computes on whole tensors."""
    inputs = prim_inputs(call)
    table, ids = inputs[0], inputs[1]
    axis = int(inputs[2]) if len(inputs) > 2 else 0
    if axis != 0 or table.ndim != 2:
        return replicated_rule(call)
    return embedding_rule(with_inputs(call, (table, ids)))


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("embedding", embedding_rule)
ATEN_OPS.add("embedding_dense_backward", lambda c: embedding_backward_rule(c, ()))

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("Gather", gather_rows_rule)
