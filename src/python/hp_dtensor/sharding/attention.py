"""Scaled dot-product attention on (batch, heads, seq, head_dim) tensors.

Batch or head sharding is embarrassingly parallel: q, k, v (and the mask, where it has those dims)
share the shard and the outputs keep it.  Sequence or head-dim shards are gathered first (context
parallelism is a different style).
"""

from __future__ import annotations

from hp_dtensor.placement_types import Placement, Replicate, Shard
from hp_dtensor.sharding.op_call import Decision, OpCall, OpRules


def _common(q_pl: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(p if isinstance(p, Shard) and p.dim in (0, 1) else Replicate() for p in q_pl)


def sdpa_rule(call: OpCall, n_qkv_like: int, n_outputs: int, lse_outputs: tuple[int, ...] = ()) -> Decision:
    """Inputs: the first ``n_qkv_like`` DTensors are 4-D (B, H, S, D) and share placements; any
    further DTensor (the mask) is broadcast over the shard when it has size 1 there."""
    infos = call.tensors()
    req = _common(infos[0].placements)
    ins: list[tuple[Placement, ...]] = [req] * n_qkv_like
    for t in infos[n_qkv_like:]:
        lead = 4 - t.ndim
        ins.append(
            tuple(
                Shard(p.dim - lead)
                if isinstance(p, Shard) and p.dim - lead >= 0 and t.shape[p.dim - lead] != 1
                else Replicate()
                for p in req
            )
        )
    outs = tuple(req for _ in range(n_outputs))
    return Decision(tuple(ins), outs)


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("_scaled_dot_product_flash_attention_for_cpu", lambda c: sdpa_rule(c, 3, 2))
ATEN_OPS.add("_scaled_dot_product_flash_attention_for_cpu_backward", lambda c: sdpa_rule(c, 6, 3))
