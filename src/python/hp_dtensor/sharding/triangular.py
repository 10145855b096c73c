"""``tril``/``triu`` on the last two dims.

A shard on either matrix dim stays: the rank masks its block with the diagonal moved by the
block's offset (row offset minus column offset), done by the platform's ``triangular`` kernel
with the global shape.  Leading dims flow; masking is linear, so a Partial flows too.
"""

from __future__ import annotations

from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules, TensorInfo


def triangular_rule(call: OpCall) -> Decision:
    t: TensorInfo = call.args[0]
    diagonal = call.args[1] if len(call.args) > 1 else call.kwargs.get("diagonal", 0)
    return Decision((t.placements,), (t.placements,), args=(t, diagonal, t.shape), kwargs={}, kernel="triangular")


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("tril triu", triangular_rule)
