"""Vocab-parallel cross entropy, written once for every backend.

Logits whose class dim is sharded over one mesh dim (replicated over the others) are never
gathered.  Forward issues two all_reduces over the vocab ranks: the row max (with one more
element: whether any rank's arguments failed their checks), then the row sums stacked into one
tensor (sum of exp, the target's shifted logit, the label-smoothing sum when smoothing; for
class-probability targets the target-weighted sums).  Every rank then holds the same loss.  The
backward is local: the softmax gradient is folded into the loss gradient, so each rank computes
its own slice's gradient from the row sums it already has.

The result is ``torch.nn.functional.cross_entropy``'s on the whole logits, over its whole argument
surface: ``(N, C, d1, ...)`` or ``(C,)`` logits, class-index or class-probability targets,
``weight``, ``ignore_index``, ``label_smoothing`` and every ``reduction``.  Arguments are checked
(``loss_parallel_rules``) on every rank: the logits' layout before any collective, the per-rank
target/weight/options before the loss, with the verdict shared by the row-max all_reduce, so a
rank whose arguments alone are wrong makes every rank raise instead of leaving them waiting.  A
backend supplies how a call is intercepted, its tensor primitives (``LossMath``) and how a
forward/backward pair becomes a differentiable function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hp_dtensor.api.dtensor_methods import DTensorMethods
from hp_dtensor.placement_types import ReduceOp, Replicate
from hp_dtensor.redistribute.executor import PlanPrimitives, reduce_over
from hp_tp import loss_parallel_rules as rules


class LossMath(Protocol):
    """The tensor primitives the loss is written in.  Tensors are the framework's own; ``+ - * /``,
    negation and comparisons with tensors or Python numbers are used directly.  ``dim`` reductions
    keep the reduced dim."""

    def is_tensor(self, x: Any) -> bool: ...

    def is_floating(self, t: Any) -> bool: ...

    def is_bool(self, t: Any) -> bool: ...

    def as_index(self, t: Any) -> Any:
        """An integer tensor as int64 (``uint8`` class indices must not wrap when shifted)."""
        ...

    def requires_grad(self, t: Any) -> bool: ...

    def shape(self, t: Any) -> tuple[int, ...]: ...

    def detach(self, t: Any) -> Any: ...

    def cast(self, t: Any, like: Any) -> Any:
        """``t`` in ``like``'s floating dtype (bool becomes 0.0 / 1.0)."""
        ...

    def amax(self, t: Any, dim: int) -> Any:
        """Max over ``dim``; ``-inf`` where ``dim`` has no elements (an empty vocab slice)."""
        ...

    def sum(self, t: Any, dim: int) -> Any: ...

    def total(self, t: Any) -> Any:
        """Sum of every element, 0-D."""
        ...

    def exp(self, t: Any) -> Any: ...

    def log(self, t: Any) -> Any: ...

    def logical_and(self, a: Any, b: Any) -> Any: ...

    def logical_or(self, a: Any, b: Any) -> Any: ...

    def where(self, cond: Any, t: Any, other: float) -> Any:
        """``t`` where ``cond`` holds, else the number ``other``."""
        ...

    def clamp(self, t: Any, low: int, high: int) -> Any: ...

    def full(self, like: Any, n: int, value: float) -> Any:
        """A 1-D tensor of ``n`` elements equal to ``value``, in ``like``'s dtype."""
        ...

    def cat(self, ts: list[Any], dim: int) -> Any: ...

    def unbind(self, t: Any, dim: int) -> tuple[Any, ...]: ...

    def unsqueeze(self, t: Any, dim: int) -> Any: ...

    def reshape(self, t: Any, shape: tuple[int, ...]) -> Any: ...

    def narrow(self, t: Any, dim: int, start: int, length: int) -> Any: ...

    def gather(self, t: Any, dim: int, index: Any) -> Any:
        """``t`` picked along ``dim`` at integer ``index`` (``torch.gather``)."""
        ...

    def scatter_add(self, t: Any, dim: int, index: Any, src: Any) -> Any:
        """A copy of ``t`` with ``src`` added along ``dim`` at ``index`` (``torch.scatter_add``)."""
        ...

    def take(self, t: Any, index: Any) -> Any:
        """1-D ``t`` indexed by an integer tensor of any shape (``t[index]``)."""
        ...

    def first_value(self, t: Any, mask: Any) -> int | None:
        """The first element of ``t`` where ``mask`` holds, or None when none does."""
        ...


@dataclass(frozen=True)
class VocabSlice:
    """This rank's classes: ``[start, start + width)`` of ``num_classes``, ``torch.chunk``'s split."""

    start: int
    width: int


@dataclass
class _Saved:
    """What backward needs of forward."""

    call: rules.CrossEntropyCall
    width: int
    shifted: Any
    lse: Any
    denom: Any
    # class-index targets
    valid: Any = None
    index: Any = None
    owned: Any = None
    w_rows: Any = None
    w_local: Any = None
    w_total: Any = None
    # class-probability targets
    wy: Any = None
    wy_sum: Any = None


#: ``(local logits, target, weight) -> loss``, with the gradient of the local logits only.
ApplyFn = Callable[[Any, Any, Any], Any]
#: A backend's differentiable function from a forward ``(x, target, weight) -> (loss, saved)`` and
#: a backward ``(saved, grad) -> grad of x``.
MakeFunction = Callable[[Callable[[Any, Any, Any], "tuple[Any, _Saved]"], Callable[["_Saved", Any], Any]], ApplyFn]


def cross_entropy(
    m: LossMath,
    collectives: PlanPrimitives,
    function: MakeFunction,
    input: DTensorMethods,
    target: Any,
    weight: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Any:
    """``F.cross_entropy`` on class-sharded DTensor logits; a replicated DTensor loss."""
    input_shape = tuple(int(n) for n in input._spec.shape)
    # The layout is the DTensor's spec, the same on every rank: a bad one raises here, everywhere.
    cdim, vocab_mesh_dim = rules.check_layout(input_shape, tuple(input.placements))
    mesh = input.device_mesh
    local = input.to_local()

    def reduce(t: Any, op: ReduceOp) -> Any:
        return reduce_over(t, mesh, (vocab_mesh_dim,), op, collectives)

    # The target, weight and options are plain per-rank values: normally the same everywhere, but a
    # rank whose check fails alone must not leave the others waiting in the all_reduce.  This
    # rank's verdict (its checks failed, or a class index is out of range: counted on the device)
    # rides on the row-max all_reduce, so there is no extra collective and one host sync in all.
    # If any rank failed, every rank raises: the failed ones their own error (torch's, when every
    # rank was given the same arguments), the others ``OtherRanksFailed``.
    error: Exception | None = None
    bad = None
    try:
        call, tgt, w, vocab, bad = _checked(m, input_shape, input.placements, local, mesh, target, weight,
                                            ignore_index, reduction, label_smoothing)
    except Exception as e:  # noqa: BLE001 -- any error, even a bug, must reach the other ranks
        error = e
    row_max = m.amax(m.detach(local), cdim)
    rows = m.shape(row_max)
    flat = m.reshape(row_max, (-1,))
    k = m.shape(flat)[0]
    verdict = m.full(flat, 1, 0.0 if error is None else 1.0)
    if bad is not None:
        verdict = verdict + m.reshape(m.total(m.cast(bad, flat)), (1,))
    agreed = reduce(m.cat([flat, verdict], 0), "max")
    if float(m.total(m.narrow(agreed, 0, k, 1))) > 0:
        if error is not None:
            raise error
        if bad is not None:
            rules.check_target_range(m.first_value(tgt, bad))
        raise rules.other_ranks_failed()
    row_max = m.reshape(m.narrow(agreed, 0, 0, k), rows)

    def fwd(x: Any, t: Any, wt: Any) -> tuple[Any, _Saved]:
        return forward(m, x, t, wt, call, ignore_index, vocab, reduce, row_max)

    loss = function(fwd, lambda saved, grad: backward(m, saved, grad))(local, tgt, w)
    return type(input).from_local(  # type: ignore[attr-defined]
        loss, mesh, [Replicate()] * mesh.ndim, run_check=False
    )


def _checked(
    m: LossMath, input_shape: tuple[int, ...], placements: Any, local: Any, mesh: Any, target: Any,
    weight: Any, ignore_index: int, reduction: str, label_smoothing: float,
) -> tuple[rules.CrossEntropyCall, Any, Any, VocabSlice, Any]:
    """This rank's checks of the per-rank arguments: (the call, target, weight, vocab slice, the
    mask of out-of-range class indices or None).  The mask is checked after the all_reduce that
    shares the verdict, so the host syncs once."""
    tgt = _whole(m, target)
    w = None if weight is None else _whole(m, weight)
    call = rules.check_cross_entropy(
        input_shape, tuple(placements), m.shape(tgt), m.is_floating(tgt),
        None if w is None else m.shape(w), reduction, label_smoothing, target_is_bool=m.is_bool(tgt),
    )
    if (w is not None and m.requires_grad(w)) or (m.is_floating(tgt) and m.requires_grad(tgt)):
        raise NotImplementedError(
            "loss_parallel computes no gradient for cross_entropy's weight or target; detach them"
        )
    n = mesh.size(call.vocab_mesh_dim)
    index = mesh.get_local_rank(call.vocab_mesh_dim)
    # the local width, not the chunk's: indices then stay in bounds on every rank even for a
    # DTensor built by from_local(run_check=False) with pieces that are not torch.chunk's
    vocab = VocabSlice(vocab_start(call.num_classes, n, index), m.shape(local)[call.class_dim])
    if call.target_kind is rules.TargetKind.CLASS_INDEX:
        tgt = m.as_index(tgt)
        bad = m.logical_and(tgt != ignore_index, m.logical_or(tgt < 0, tgt >= call.num_classes))
        return call, tgt, w, vocab, bad
    return call, m.narrow(tgt, call.class_dim, vocab.start, vocab.width), w, vocab, None


def vocab_start(num_classes: int, n: int, index: int) -> int:
    """The first class of the ``index``-th of ``n`` vocab ranks: ``torch.chunk``'s split, so with an
    uneven vocab the last ranks hold fewer classes (or none), and a rank's offset is not ``index``
    times its own width."""
    return min(num_classes, index * -(-num_classes // n))


def _whole(m: LossMath, t: Any) -> Any:
    """A target or weight argument as the whole plain tensor."""
    if isinstance(t, DTensorMethods):
        return t.full_tensor() if any(not p.is_replicate() for p in t.placements) else t.to_local()
    if not m.is_tensor(t):
        raise TypeError(f"loss_parallel: cross_entropy expects tensor target/weight, got {type(t).__name__}")
    return t


def _class_view(m: LossMath, t: Any, cdim: int, ndim: int) -> Any:
    """``t`` of shape ``(C_local,)`` shaped to broadcast along the class dim of ``ndim``-D logits."""
    shape = [1] * ndim
    shape[cdim] = m.shape(t)[0]
    return m.reshape(t, tuple(shape))


def forward(
    m: LossMath,
    x: Any,
    target: Any,
    weight: Any,
    call: rules.CrossEntropyCall,
    ignore_index: int,
    vocab: VocabSlice,
    reduce: Callable[[Any, ReduceOp], Any],
    row_max: Any,
) -> tuple[Any, _Saved]:
    """The loss from this rank's logits slice ``x`` and the row max over every vocab rank
    (reduced by the caller); one more all_reduce through ``reduce``."""
    cdim, nc, eps = call.class_dim, call.num_classes, call.label_smoothing
    ndim = len(m.shape(x))
    start, width = vocab.start, vocab.width
    w_local = None
    if weight is not None:
        w_local = _class_view(m, m.cast(m.narrow(weight, 0, start, width), x), cdim, ndim)
    xd = m.detach(x)
    # The shift cancels in the gradient, so the max is a constant (no gradient through it).
    shifted = xd - row_max
    sum_exp_local = m.sum(m.exp(shifted), cdim)
    if call.target_kind is rules.TargetKind.CLASS_INDEX:
        valid = target != ignore_index
        valid_f = m.cast(valid, x)
        t = m.unsqueeze(target - start, cdim)
        owned = m.logical_and(m.unsqueeze(valid, cdim), m.logical_and(t >= 0, t < width))
        index = m.clamp(t, 0, max(width - 1, 0))
        # Masks select (``where``), never multiply: a -inf logit times a 0 mask is NaN, and the
        # logits of a row another rank owns, or of an ignored row, must not reach the loss.
        if width:
            picked = m.where(owned, m.gather(shifted, cdim, index), 0.0)
        else:
            picked = sum_exp_local * 0.0  # no classes here: nothing picked (shape of a row sum)
        sums = [sum_exp_local, picked]
        if eps:  # without smoothing the class sum is not needed (and a -inf logit makes it -inf)
            sums.append(m.sum(shifted if w_local is None else shifted * w_local, cdim))
        sum_exp, picked, *smooth = m.unbind(reduce(m.cat(sums, cdim), "sum"), cdim)
        lse = m.log(sum_exp)
        w_total: Any
        if weight is None:
            w_rows, w_total = valid_f, float(nc)
        else:
            w_full = m.cast(weight, x)
            w_rows = m.take(w_full, m.where(valid, target, 0)) * valid_f
            w_total = m.total(w_full)
        per = (1 - eps) * (lse - picked) * w_rows
        if eps:
            per = per + (eps / nc) * (lse * w_total - smooth[0])
        # An ignored row adds exactly 0 whatever its logits hold (NaN or inf padding), as in torch.
        per = m.where(valid, per, 0.0)
        saved = _Saved(call, width, shifted, lse, m.total(w_rows), valid=valid, index=index,
                       owned=m.cast(owned, x), w_rows=w_rows, w_local=w_local, w_total=w_total)
    else:
        y = m.cast(target, x) * (1 - eps) + eps / nc
        wy = y if w_local is None else y * w_local
        sums = reduce(m.cat([sum_exp_local, m.sum(wy * shifted, cdim), m.sum(wy, cdim)], cdim), "sum")
        sum_exp, wy_x, wy_sum = m.unbind(sums, cdim)
        lse = m.log(sum_exp)
        per = lse * wy_sum - wy_x
        count = 1
        for s in m.shape(per):
            count *= s
        saved = _Saved(call, width, shifted, lse, float(count), wy=wy, wy_sum=wy_sum)
    if call.reduction is rules.Reduction.NONE:
        return per, saved
    if call.reduction is rules.Reduction.SUM:
        return m.total(per), saved
    return m.total(per) / saved.denom, saved


def backward(m: LossMath, s: _Saved, grad: Any) -> Any:
    """The gradient of this rank's logits slice: local, no collective."""
    call = s.call
    cdim, nc, eps = call.class_dim, call.num_classes, call.label_smoothing
    g = grad / s.denom if call.reduction is rules.Reduction.MEAN else grad
    prob = m.exp(s.shifted - m.unsqueeze(s.lse, cdim))
    if call.target_kind is rules.TargetKind.CLASS_INDEX and not eps and call.reduction is not rules.Reduction.NONE:
        # Without smoothing: w_t (p_c - [c = t]) g, with the scalar g folded into the row weights so
        # the (rows x classes) block is written twice (prob * w, the target's -w), not five times.
        w = m.unsqueeze(s.w_rows * g, cdim)
        gx = prob * w
        if s.width:
            gx = m.scatter_add(gx, cdim, s.index, -w * s.owned)
        # Ignored rows get exactly 0, as in torch, even when their logits hold NaN or inf.
        return m.where(m.unsqueeze(s.valid, cdim), gx, 0.0)
    if call.target_kind is rules.TargetKind.CLASS_INDEX:
        # d loss / d x_c = (1 - eps) w_t (p_c - [c = t]) + eps / C (W p_c - w_c) on valid rows, W the
        # sum of all class weights.
        valid_f = m.unsqueeze(m.cast(s.valid, s.shifted), cdim)
        smooth_grad = prob * nc - 1.0 if s.w_local is None else prob * s.w_total - s.w_local
        gx = (1 - eps) * prob * m.unsqueeze(s.w_rows, cdim) + (eps / nc) * smooth_grad * valid_f
        if s.width:
            gx = m.scatter_add(gx, cdim, s.index, -(1 - eps) * m.unsqueeze(s.w_rows, cdim) * s.owned)
    else:
        gx = prob * m.unsqueeze(s.wy_sum, cdim) - s.wy
    gx = gx * (m.unsqueeze(g, cdim) if call.reduction is rules.Reduction.NONE else g)
    if call.target_kind is rules.TargetKind.CLASS_INDEX:
        # Ignored rows get exactly 0, as in torch, even when a mean over no rows divides by 0.
        gx = m.where(m.unsqueeze(s.valid, cdim), gx, 0.0)
    return gx
