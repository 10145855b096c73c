"""Matrix products (mm, bmm, addmm, baddbmm) from their einsum equations.

Per mesh dim the candidates are: shard any free or batch label (inputs that carry it shard it,
the rest replicate), shard the contracted label in both inputs (output ``Partial("sum")``),
one ``Partial`` input with the rest replicated (the product is linear in each factor), or all
replicated.  The cheapest by the planner's cost model wins.
"""

from __future__ import annotations

from hp_dtensor.placement_types import Partial, Placement, Replicate, Shard
from hp_dtensor.sharding.op_args import with_inputs
from hp_dtensor.sharding.op_call import (
    Decision,
    OpCall,
    OpRules,
    TensorInfo,
    cheapest,
    per_mesh_dim,
    replicated_rule,
)
from hp_dtensor.sharding.pointwise import _follow


def _einsum_candidates(
    inputs: list[str], output: str, cur: list[Placement]
) -> list[tuple[list[Placement], Placement]]:
    labels = sorted(set("".join(inputs)), key=lambda c: ("".join(inputs)).index(c))
    cands: list[tuple[list[Placement], Placement]] = []
    for lab in labels:
        if lab in output:
            req: list[Placement] = [Shard(s.index(lab)) if lab in s else Replicate() for s in inputs]
            cands.append((req, Shard(output.index(lab))))
        elif all(lab in s for s in inputs):
            cands.append(([Shard(s.index(lab)) for s in inputs], Partial("sum")))
    for i, p in enumerate(cur):
        if isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            req = [Replicate() for _ in inputs]
            req[i] = p
            cands.append((req, p))
    cands.append(([Replicate() for _ in inputs], Replicate()))
    # Prefer candidates that keep the current input placements (stable, cheaper plans first).
    return cands


def einsum_rule(call: OpCall, equation: str, *, has_bias: bool = False) -> Decision:
    lhs, output = equation.split("->")
    inputs = lhs.split(",")
    infos = call.tensors()
    factors = infos[1:] if has_bias else infos
    out_shape = tuple(
        next(f.shape[s.index(c)] for f, s in zip(factors, inputs) if c in s) for c in output
    )

    def choose(k: int, cur: list[Placement]) -> tuple[list[Placement], list[Placement]]:
        fac_cur = cur[1:] if has_bias else cur
        cands = []
        for req, out in _einsum_candidates(inputs, output, fac_cur):
            if has_bias:
                bias = infos[0]
                if isinstance(out, Shard):
                    bias_p = _follow(bias, out.dim, len(output), out_shape)
                elif isinstance(out, Partial):
                    bias_p = out
                else:
                    bias_p = Replicate()
                req = [bias_p] + req
            cands.append((req, [out]))
        return cheapest(cands, cur, infos, call.mesh_shape[k])

    return per_mesh_dim(call, choose, 1)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def batch_labels(n: int, skip: str) -> str:
    """``n`` einsum labels for batch dims, none of them in ``skip``."""
    return "".join(c for c in _LETTERS if c not in skip)[:n]


def matmul_equation(a: TensorInfo, b: TensorInfo, ta: bool = False, tb: bool = False) -> str:
    """The einsum equation of ``matmul(a, b)`` (``ta``/``tb``: the operand's last two dims are
    transposed), with numpy's broadcasting of batch dims and 1-D operands."""
    if a.ndim < 1 or b.ndim < 1:
        raise ValueError("matmul of a 0-d DTensor")
    batch_a = a.ndim - 2 if a.ndim >= 2 else 0
    batch_b = b.ndim - 2 if b.ndim >= 2 else 0
    nb = max(batch_a, batch_b)
    batch = batch_labels(nb, "mkn")
    la = (batch[nb - batch_a:] if batch_a else "") + (("km" if ta else "mk") if a.ndim >= 2 else "k")
    lb = (batch[nb - batch_b:] if batch_b else "") + (("nk" if tb else "kn") if b.ndim >= 2 else "k")
    out = batch + ("m" if a.ndim >= 2 else "") + ("n" if b.ndim >= 2 else "")
    return f"{la},{lb}->{out}"


def transposed_matmul_rule(call: OpCall) -> Decision:
    """``MatMul(a, b, transpose_a, transpose_b)`` / ``BatchMatMul`` (the flags positional or by
    keyword)."""
    a, b = call.args[0], call.args[1]
    ta = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("transpose_a", False))
    tb = bool(call.args[3]) if len(call.args) > 3 else bool(call.kwargs.get("transpose_b", False))
    return einsum_rule(call, matmul_equation(a, b, ta, tb))


def matmul_rule(call: OpCall) -> Decision:
    """``matmul(a, b)`` with numpy broadcasting; batch dims that differ (broadcast against each
    other) compute on whole tensors."""
    a, b = call.args[0], call.args[1]
    if a.ndim > 2 and b.ndim > 2 and a.shape[:-2] != b.shape[:-2]:
        return replicated_rule(call)
    return einsum_rule(call, matmul_equation(a, b, False, False))


def dense_rule(call: OpCall) -> Decision:
    """``Dense(x, weight[out, in], bias)``: x @ weight.T + bias."""
    x, w = call.args[0], call.args[1]
    bias = call.args[2] if len(call.args) > 2 else None
    batch = batch_labels(x.ndim - 1, "kn")
    eq = f"{batch}k,nk->{batch}n"
    if not isinstance(bias, TensorInfo):
        return einsum_rule(with_inputs(call, (x, w)), eq)
    dec = einsum_rule(with_inputs(call, (bias, x, w)), eq, has_bias=True)
    b_req, x_req, w_req = dec.inputs
    return Decision((x_req, w_req, b_req), dec.outputs)


# ---------------------------------------------------------------- the ops these rules cover
ATEN_OPS = OpRules("aten", "default")
ATEN_OPS.add("mm", lambda c: einsum_rule(c, "mk,kn->mn"))
ATEN_OPS.add("bmm", lambda c: einsum_rule(c, "bmk,bkn->bmn"))
ATEN_OPS.add("addmm", lambda c: einsum_rule(c, "mk,kn->mn", has_bias=True))
ATEN_OPS.add("baddbmm", lambda c: einsum_rule(c, "bmk,bkn->bmn", has_bias=True))
ATEN_OPS.add("mv", lambda c: einsum_rule(c, "mk,k->m"))
ATEN_OPS.add("dot", lambda c: einsum_rule(c, "k,k->"))

MINDSPORE_OPS = OpRules()
MINDSPORE_OPS.add("MatMul BatchMatMul", transposed_matmul_rule)
MINDSPORE_OPS.add("MatMulExt Matmul", matmul_rule)
MINDSPORE_OPS.add("Dense", dense_rule)
