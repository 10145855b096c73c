"""Pointwise ops with broadcasting.

Per mesh dim: if any input is sharded on a dim that survives broadcasting, the output is sharded
on that (output) dim and every input follows it (broadcast inputs are replicated).  With no shard,
a ``Partial`` input stays ``Partial`` only through ops linear in it (``linear_args``); otherwise it
is reduced first.  In-place ops keep ``self``'s placement.
"""

from __future__ import annotations

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo, cheapest, per_mesh_dim


def _out_shape(infos: list[TensorInfo]) -> tuple[int, ...]:
    ndim = max((t.ndim for t in infos), default=0)
    shape = [1] * ndim
    for t in infos:
        for i, s in enumerate(t.shape):
            j = i + ndim - t.ndim
            if s != 1:
                shape[j] = s
    return tuple(shape)


def _follow(t: TensorInfo, out_dim: int, out_ndim: int, out_shape: tuple[int, ...]) -> Placement:
    """Placement for input ``t`` when the output is sharded on ``out_dim``."""
    d = out_dim - (out_ndim - t.ndim)
    if d >= 0 and t.shape[d] == out_shape[out_dim]:
        return Shard(d)
    return Replicate()


def pointwise_rule(
    call: OpCall, *, linearity: str | None = None, inplace: bool = False, n_outputs: int = 1
) -> Decision:
    """``linearity`` says how a ``Partial`` input may flow through the op without reduction:
    ``"add"`` (linear in all inputs jointly: every input becomes Partial), ``"mul"`` (linear in any
    one input while the others are Replicate), ``"div"`` (linear in the first input only),
    ``None`` (not linear: Partial inputs are reduced first)."""
    infos = call.tensors()
    out_shape = _out_shape(infos)
    out_ndim = len(out_shape)

    def choose(k: int, cur: list[Placement]) -> tuple[list[Placement], list[Placement]]:
        n = call.mesh_shape[k]
        if inplace:
            self_p = cur[0]
            if isinstance(self_p, Shard):
                od = self_p.dim + (out_ndim - infos[0].ndim)
                return [_follow(t, od, out_ndim, out_shape) for t in infos], [self_p] * n_outputs
            if isinstance(self_p, Replicate):
                return [Replicate() for _ in infos], [Replicate()] * n_outputs
            assert isinstance(self_p, Partial)
            req = _partial_inputs(cur, linearity, self_p, force_first=True)
            if req is None:
                raise ValueError(
                    f"in-place {call.name} on a {self_p!r} tensor cannot be computed without reducing it "
                    f"first; call .redistribute(placements=[Replicate()]) before the op"
                )
            return req, [self_p] * n_outputs
        cands: list[tuple[list[Placement], list[Placement]]] = []
        for i, t in enumerate(infos):
            p = cur[i]
            if isinstance(p, Shard):
                od = p.dim + (out_ndim - t.ndim)
                cands.append(([_follow(u, od, out_ndim, out_shape) for u in infos], [Shard(od)] * n_outputs))
        partials = [p for p in cur if isinstance(p, Partial)]
        if partials:
            req = _partial_inputs(cur, linearity, partials[0], force_first=False)
            if req is not None:
                cands.append((req, [partials[0]] * n_outputs))
        cands.append(([Replicate() for _ in infos], [Replicate()] * n_outputs))
        return cheapest(cands, cur, infos, n)

    return per_mesh_dim(call, choose, n_outputs)


def _partial_inputs(
    cur: list[Placement], linearity: str | None, target: Partial, *, force_first: bool
) -> list[Placement] | None:
    """Required inputs for a ``target`` Partial output, or None when the op is not linear there."""
    if linearity is None or target.reduce_op not in ("sum", "avg"):
        return None
    if any(isinstance(p, Partial) and p != target for p in cur):
        return None
    if linearity == "add":
        return [target for _ in cur]
    n_partial = sum(isinstance(p, Partial) for p in cur)
    if linearity == "mul" and n_partial == 1:
        return [p if isinstance(p, Partial) else Replicate() for p in cur]
    if linearity == "div" and isinstance(cur[0], Partial) and n_partial == 1:
        return [target] + [Replicate() for _ in cur[1:]]
    if force_first and linearity == "mul" and isinstance(cur[0], Partial):
        return [target] + [Replicate() for _ in cur[1:]]
    return None
