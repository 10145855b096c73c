"""The framework-neutral parts of op dispatch that the backends used to carry, on plain values.

Argument readers of both calling conventions, the gradient-term bookkeeping of a backend whose
autograd runs on local tensors, the in-place update rule, the foreach split and the interceptor
stack: each checked against hand-computed answers, with no framework imported.
"""

from __future__ import annotations

import pytest

from hp_dtensor.placement_types import Partial, Replicate, Shard
from hp_dtensor.sharding.dispatch import holds_dtensor
from hp_dtensor.sharding.foreach import list_length, local_foreach_args, one_entry_calls
from hp_dtensor.sharding.interceptors import intercepting, pop_interceptor, push_interceptor
from hp_dtensor.sharding.local_grads import GradLayout, grad_facts
from hp_dtensor.sharding.local_updates import local_update_rule
from hp_dtensor.sharding.op_args import dims_arg, int_arg, keepdim_arg, prim_inputs, reduce_args
from hp_dtensor.sharding.op_call import Decision, OpCall, TensorInfo
from hp_dtensor.sharding.python_values import global_compare_rule
from hp_dtensor.sharding.reductions import reduction_family

R, S0, S1, PS, PA = Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg")


def _t(shape: tuple[int, ...], *pl: object) -> TensorInfo:
    return TensorInfo(shape, tuple(pl))  # type: ignore[arg-type]


def test_argument_readers_positional_keyword_and_primitive_forms() -> None:
    x = _t((4, 6), S0)
    assert dims_arg(OpCall("aten.sum.dim_IntList", (2,), (x, [1])), 1) == [1]
    assert dims_arg(OpCall("aten.sum.dim_IntList", (2,), (x,), {"dim": 0}), 1) == [0]
    assert dims_arg(OpCall("aten.sum.default", (2,), (x,)), 1) is None
    assert keepdim_arg(OpCall("aten.sum.dim_IntList", (2,), (x, [1], True)), 2) is True
    assert keepdim_arg(OpCall("aten.sum.dim_IntList", (2,), (x, [1]), {"keepdim": True}), 2) is True
    assert int_arg(OpCall("aten.mse_loss.default", (2,), (x, x)), 2, "reduction", 1) == 1
    prim_call = OpCall("ReduceSum", (2,), ("prim", "ReduceSum", [x, [0, 1], True]))
    assert prim_inputs(prim_call) == (x, [0, 1], True)
    assert reduce_args(prim_call) == (x, [0, 1], True)
    assert reduce_args(OpCall("SumExt", (2,), (x, 1, False))) == (x, [1], False)
    with pytest.raises(NotImplementedError, match="skip_mode"):
        reduce_args(OpCall("ReduceSum", (2,), ("prim", "ReduceSum", [x, [], False, True])))


def test_max_over_a_sharded_dim_runs_the_extremum_kernel_replicated() -> None:
    x = _t((4, 6), S0)
    dec = reduction_family("amax")(OpCall("ReduceMax", (2,), (x, 0, False)))
    assert dec.kernel == "extremum_amax" and dec.outputs == ((R,),)
    kept = reduction_family("amax")(OpCall("ReduceMax", (2,), (x, 1, False)))
    assert kept.kernel is None and kept.outputs == ((S0,),)


def test_grad_facts_sum_terms_scale_avg_and_pass_through() -> None:
    # A replicated input feeding a column-sharded output: its local gradient is one term per rank.
    w, x = _t((4, 4), R), _t((4, 4), S1)
    facts = grad_facts(OpCall("MatMul", (2,), (w, x)), Decision((None, None), ((S1,),)))
    assert facts.grad_dims == ((0,), ()) and facts.transparent == (False, False) and facts.grad_scale == (1.0, 1.0)
    # A mean over a sharded dim: Partial("avg") output, the input's gradient takes 1/4.
    y = _t((8,), S0)
    facts = grad_facts(OpCall("MeanExt", (4,), (y,)), Decision((None,), ((PA,),)))
    assert facts.grad_scale == (0.25,) and facts.grad_dims == ((),)
    # A replicated op on a replicated input passes its gradient through in any form.
    facts = grad_facts(OpCall("Exp", (2,), (_t((3,), R),)), Decision((None,), ((R,),)))
    assert facts.transparent == (True,)


def test_grad_layout_first_consumer_decides() -> None:
    layout = GradLayout()
    assert layout.adapt((0,)) == ((), ())  # the first consumer's terms become the layout
    assert layout.adapt(()) == ((), (0,))  # a whole-gradient consumer keeps its part on root only
    assert layout.adapt((0, 1)) == ((1,), ())  # terms on a dim the layout wants whole are summed
    whole = GradLayout()
    assert whole.whole_use() == () and whole.adapt((0,)) == ((0,), ())


def test_local_update_refuses_partial_unless_it_commutes() -> None:
    rule = local_update_rule({"InplaceMuls"})
    p, g = _t((4,), PS), _t((4,), PS)
    assert rule(OpCall("InplaceMuls", (2,), (p, 0.5))).outputs == ((PS,),)
    with pytest.raises(ValueError, match="InplaceAddExt.*partial term"):
        rule(OpCall("InplaceAddExt", (2,), (p, g)))
    sharded = _t((5,), S0)
    dec = rule(OpCall("AdamW", (2,), (sharded, sharded)))
    assert dec.inputs == (None, None) and dec.out_shape == (5,)


def test_equal_of_different_shapes_is_false_without_communication() -> None:
    a, b = _t((4,), S0), _t((5,), S0)
    assert global_compare_rule(OpCall("aten.equal.default", (2,), (a, b))).kernel == "constant_false"
    same = global_compare_rule(OpCall("aten.equal.default", (2,), (_t((4,), PS), _t((4,), PS))))
    assert same.kernel == "all_ranks_agree" and same.inputs == ((R,), (R,))


class _FakeDT:
    def __init__(self, spec: object, local: object) -> None:
        self._spec, self.local = spec, local


class _Spec:
    def __init__(self, placements: tuple[object, ...]) -> None:
        self.placements = placements


class _FakePlain:
    """A plain tensor: the DTensor type's base, as ``torch.Tensor`` is."""


class _FakeDTensor(_FakePlain, _FakeDT):
    pass


def test_foreach_runs_locally_only_for_one_layout_without_partial() -> None:
    spec = _Spec((S0,))
    a, b = _FakeDTensor(spec, "a"), _FakeDTensor(spec, "b")

    def local(args: tuple[object, ...], n: int) -> object:
        return local_foreach_args(args, n, _FakeDTensor, _FakePlain, lambda x: x.local)

    assert local(([a, b], [a, b], 2.0), 2) == ((["a", "b"], ["a", "b"], 2.0), [spec, spec])
    other = _FakeDTensor(_Spec((R,)), "c")
    assert local(([a, b], [other, b]), 2) is None  # two layouts at one position
    partial = _FakeDTensor(_Spec((PS,)), "p")
    assert local(([partial],), 1) is None
    # a position of plain tensors runs as it is (spec None); a plain tensor beside a DTensor at
    # one position goes through the rules
    plain, plain2 = _FakePlain(), _FakePlain()
    assert local(([a, plain], [b, plain2], 0.5), 2) == ((["a", plain], ["b", plain2], 0.5), [spec, None])
    assert local(([a, plain], [plain2, b]), 2) is None
    assert list(one_entry_calls(([a, b], 3.0), 2)) == [([a], 3.0), ([b], 3.0)]
    assert holds_dtensor(([a], 3.0), _FakeDTensor) and not holds_dtensor(([plain], [plain2]), _FakeDTensor)
    assert list_length("op", ([a, b], [a, b], 1.0)) == 2
    with pytest.raises(RuntimeError, match=r"op: its tensor lists must have the same number of entries, got lengths \[2, 1\]"):
        list_length("op", ([a, b], [a]))


def test_interceptors_nest_and_refuse_out_of_order_pops() -> None:
    def first(op: object, args: object, kwargs: object) -> None:
        return None

    def second(op: object, args: object, kwargs: object) -> None:
        return None

    assert not intercepting()
    push_interceptor(first)
    push_interceptor(second)
    with pytest.raises(RuntimeError, match="out of order"):
        pop_interceptor(first)
    pop_interceptor(second)
    pop_interceptor(first)
    assert not intercepting()
