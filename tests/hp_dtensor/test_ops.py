# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Every sharding rule against the same op on plain tensors, forward and backward, on 2 ranks.

Each case names an op, its inputs with their placements, and runs the op on DTensors and on the
unsharded tensors with the same values; outputs (``full_tensor``) and every input gradient must
agree at fp32 tolerances.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2)


def _cases() -> dict[str, tuple[Callable[..., Any], list[tuple[Any, Any]]]]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Partial, Replicate, Shard

    R, S = Replicate(), Shard
    g = torch.Generator().manual_seed(0)

    def rn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g)

    ids = torch.randint(0, 8, (2, 4), generator=g)
    tgt = torch.randint(0, 10, (8,), generator=g)
    return {
        "linear_colwise": (F.linear, [(rn(2, 4, 8), R), (rn(6, 8), S(0)), (rn(6), S(0))]),
        "linear_rowwise": (F.linear, [(rn(2, 4, 8), S(-1)), (rn(6, 8), S(1)), (rn(6), R)]),
        "linear_sequence_sharded": (F.linear, [(rn(2, 4, 8), S(1)), (rn(6, 8), R), (rn(6), R)]),
        "matmul_contract_sharded": (torch.matmul, [(rn(2, 4, 8), S(2)), (rn(8, 6), S(0))]),
        "bmm_batch": (torch.bmm, [(rn(4, 3, 5), S(0)), (rn(4, 5, 2), S(0))]),
        "addmm": (torch.addmm, [(rn(6), R), (rn(4, 8), S(0)), (rn(8, 6), R)]),
        "baddbmm": (torch.baddbmm, [(rn(4, 3, 2), R), (rn(4, 3, 5), S(0)), (rn(4, 5, 2), R)]),
        "embedding_colwise": (F.embedding, [(ids, R), (rn(8, 6), S(1))]),
        "embedding_rowwise": (F.embedding, [(ids, R), (rn(8, 6), S(0))]),
        "layer_norm_seq": (
            lambda x, w, b: F.layer_norm(x, (8,), w, b),
            [(rn(2, 4, 8), S(1)), (rn(8), R), (rn(8), R)],
        ),
        "rms_norm_seq": (lambda x, w: F.rms_norm(x, (8,), w, 1e-6), [(rn(2, 4, 8), S(1)), (rn(8), R)]),
        "softmax_rows": (lambda x: torch.softmax(x, -1), [(rn(4, 6), S(0))]),
        "softmax_over_sharded_dim": (lambda x: torch.softmax(x, -1), [(rn(4, 6), S(1))]),
        "log_softmax": (lambda x: torch.log_softmax(x, 1), [(rn(4, 6, 2), S(2))]),
        "sdpa_heads": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            [(rn(2, 4, 8, 16), S(1)), (rn(2, 4, 8, 16), S(1)), (rn(2, 4, 8, 16), S(1))],
        ),
        "add_broadcast": (torch.add, [(rn(4, 8), S(0)), (rn(8), R)]),
        "mul_partial_by_replicate": (torch.mul, [(rn(4, 8), Partial()), (rn(4, 8), R)]),
        "add_partials": (torch.add, [(rn(4, 8), Partial()), (rn(4, 8), Partial())]),
        "silu_gelu_sigmoid": (
            lambda x: F.silu(x) * F.gelu(x) + torch.sigmoid(x) - torch.tanh(x),
            [(rn(4, 8), S(1))],
        ),
        "div_pow_rsqrt_exp": (lambda x, y: (x / (y * y + 1)) ** 2 + torch.exp(-x.abs()), [(rn(4, 8), S(0)), (rn(4, 8), R)]),
        "where_masked": (lambda x: torch.where(x > 0, x, 0.1 * x).masked_fill(x < -1, 0), [(rn(4, 8), S(0))]),
        "dropout_p0": (lambda x: F.dropout(x, 0.0, training=True), [(rn(4, 8), S(0))]),
        "view_flatten_unflatten": (
            lambda x: x.view(2, 4, 2, 4).flatten(0, 1).unflatten(0, (4, 2)).reshape(8, 8),
            [(rn(2, 4, 8), S(0))],
        ),
        "transpose_permute": (lambda x: x.transpose(0, 1).permute(2, 0, 1).contiguous(), [(rn(2, 4, 8), S(1))]),
        "split_chunk_cat_stack": (
            lambda x: torch.cat([torch.stack(x.chunk(2, dim=1), 0).sum(0), *x.split([3, 5], dim=1)], dim=1),
            [(rn(4, 8), S(0))],
        ),
        "split_sharded_dim": (lambda x: x.split(2, dim=0)[1] * 2, [(rn(4, 8), S(0))]),
        "unsqueeze_squeeze_expand": (
            lambda x: x.unsqueeze(1).expand(4, 3, 8).sum(1).squeeze(),
            [(rn(4, 8), S(0))],
        ),
        "sum_mean_sharded_dim": (lambda x: x.sum(0) + x.mean(0) * 2, [(rn(4, 8), S(0))]),
        "sum_all": (lambda x: x.sum(), [(rn(4, 8), S(1))]),
        "amax_and_max_dim": (lambda x: x.amax(0) + x.max(dim=1).values.sum(), [(rn(4, 8), S(0))]),
        "cross_entropy_batch_sharded": (F.cross_entropy, [(rn(8, 10), S(0)), (tgt, S(0))]),
        "cumsum": (lambda x: torch.cumsum(x, 0), [(rn(4, 8), S(0))]),
        # kthvalue has no rule (no transformer step uses it): the fallback's case
        "kthvalue_fallback": (lambda x: torch.kthvalue(x, 2, dim=1).values, [(rn(4, 8), S(0))]),
    }


def _run_case(rank: int, world: int, name: str) -> dict[str, Any]:
    import warnings

    import torch

    from hp_dtensor import DTensor, init_device_mesh
    from hp_dtensor.platform.torch import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    fn, inputs = _cases()[name]
    ref_in = [t.clone().requires_grad_(t.is_floating_point()) for t, _ in inputs]
    d_in = [
        distribute_tensor(t.clone(), mesh, [p], src_data_rank=None).requires_grad_(t.is_floating_point())
        for t, p in inputs
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*d_in)
        fn(*d_in)  # a second call: the missing-rule warning must not repeat
    ref = fn(*ref_in)
    assert isinstance(out, DTensor), type(out)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref, rtol=1.5e-4, atol=1e-5)
    gout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * gout).sum().backward()
    (full * gout).sum().backward()
    for i, (r, d) in enumerate(zip(ref_in, d_in)):
        if r.grad is not None:
            assert d.grad is not None, f"input {i} got no grad"
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1.5e-4, atol=1e-5)
    return {
        "placements": out.placements,
        "rule_warnings": [str(w.message) for w in caught if "no sharding rule" in str(w.message)],
    }


CASE_NAMES = [
    "linear_colwise", "linear_rowwise", "linear_sequence_sharded", "matmul_contract_sharded", "bmm_batch",
    "addmm", "baddbmm", "embedding_colwise", "embedding_rowwise", "layer_norm_seq", "rms_norm_seq",
    "softmax_rows", "softmax_over_sharded_dim", "log_softmax", "sdpa_heads", "add_broadcast",
    "mul_partial_by_replicate", "add_partials", "silu_gelu_sigmoid", "div_pow_rsqrt_exp", "where_masked",
    "dropout_p0", "view_flatten_unflatten", "transpose_permute", "split_chunk_cat_stack", "split_sharded_dim",
    "unsqueeze_squeeze_expand", "sum_mean_sharded_dim", "sum_all", "amax_and_max_dim",
    "cross_entropy_batch_sharded", "cumsum",
]

EXPECTED_PLACEMENTS = {
    "linear_colwise": "Shard(dim=2)",
    "linear_rowwise": "Partial(sum)",
    "matmul_contract_sharded": "Partial(sum)",
    "bmm_batch": "Shard(dim=0)",
    "embedding_colwise": "Shard(dim=2)",
    "embedding_rowwise": "Partial(sum)",
    "layer_norm_seq": "Shard(dim=1)",
    "rms_norm_seq": "Shard(dim=1)",
    "sdpa_heads": "Shard(dim=1)",
    "mul_partial_by_replicate": "Partial(sum)",
    "add_partials": "Partial(sum)",
    "sum_mean_sharded_dim": "Replicate()",  # Partial(sum) + Partial(avg) must reduce first
}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_rule_matches_plain_tensors(pool2: RankPool, name: str) -> None:
    res = pool2.run(_run_case, name)
    for r in res:
        assert not r["rule_warnings"], r["rule_warnings"]
        if name in EXPECTED_PLACEMENTS:
            assert repr(r["placements"][0]) == EXPECTED_PLACEMENTS[name]


def test_op_without_rule_replicates_correctly_and_warns_once(pool2: RankPool) -> None:
    for r in pool2.run(_run_case, "kthvalue_fallback"):
        assert len(r["rule_warnings"]) == 1 and "aten.kthvalue" in r["rule_warnings"][0]
        assert repr(r["placements"][0]) == "Replicate()"


def _optimizers(rank: int, world: int, foreach: bool) -> bool:
    import torch

    from hp_dtensor import Replicate, Shard, init_device_mesh
    from hp_dtensor.platform.torch import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    layout = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for name, p in list(model.named_parameters()):
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(mod, name.rsplit(".", 1)[1],
                torch.nn.Parameter(distribute_tensor(p.data, mesh, [layout[name]], src_data_rank=None)))
    # a plain head after the sharded layers, as in a model parallelized in part: its parameters
    # share the optimizer's lists with DTensors (one foreach call steps both kinds)
    head, ref_head = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref_head.load_state_dict(head.state_dict())
    for opt_cls in (torch.optim.SGD, torch.optim.AdamW):
        kw = {"lr": 0.05, "foreach": foreach}
        if opt_cls is torch.optim.SGD:
            kw["momentum"] = 0.9
        opt = opt_cls([*model.parameters(), *head.parameters()], **kw)
        ref_opt = opt_cls([*ref.parameters(), *ref_head.parameters()], **kw)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            dx = distribute_tensor(x, mesh, [Replicate()], src_data_rank=None)
            opt.zero_grad()
            ref_opt.zero_grad()
            head(model(dx).full_tensor()).pow(2).sum().backward()
            ref_head(ref(x)).pow(2).sum().backward()
            opt.step()
            ref_opt.step()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.placements == (layout[n],), (n, p.placements)
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5)
    for p, q in zip(head.parameters(), ref_head.parameters()):
        assert type(p) is torch.nn.Parameter, type(p)  # still plain
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # a plain tensor and a DTensor at one list position are one computation: refused, as unlisted
    try:
        torch._foreach_add_([next(iter(model.parameters())).detach()], [torch.ones(16, 8)])
    except RuntimeError as e:
        assert "got a mix of torch.Tensor (shape (16, 8)) and DTensor arguments" in str(e), e
    else:
        raise AssertionError("a plain tensor beside a DTensor at one foreach position was accepted")
    # refused at one entry, an in-place foreach op has written no entry (an optimizer or a clip
    # that raises leaves every tensor as it was)
    before = [p.detach().clone() for p in model.parameters()]
    params = [p.detach() for p in model.parameters()]
    others = [distribute_tensor(torch.ones(p.shape), mesh, [Replicate()]) for p in params[:-1]] + [torch.ones(4)]
    try:
        torch._foreach_add_(params, others)
    except RuntimeError as e:
        assert "got a mix of torch.Tensor (shape (4,)) and DTensor arguments" in str(e), e
    else:
        raise AssertionError("a plain tensor beside a DTensor at the last foreach position was accepted")
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.to_local(), b.to_local()), "a refused foreach op wrote some entries"
    try:  # one scalar per entry in a tensor, where the entries must go one by one: refused, saying what to pass
        torch._foreach_addcdiv_(params[:2], others[:2], others[:2], torch.tensor([0.5, 2.0]))
    except NotImplementedError as e:
        assert "pass the scalars as a list of numbers (scalars.tolist())" in str(e), e
    else:
        raise AssertionError("a tensor of scalars for entries of different layouts was accepted")
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.to_local(), b.to_local()), "a refused foreach op wrote some entries"
    w = next(iter(model.parameters())).detach()
    try:  # lists of unequal length: refused, naming the lengths (torch checks before dispatch)
        torch._foreach_add_([w, w.clone()], [w])
    except RuntimeError as e:
        assert "must have the same number of tensors, got 2 and 1" in str(e), e
    else:
        raise AssertionError("foreach lists of unequal length were accepted")
    return True


@pytest.mark.parametrize("foreach", [False, True])
def test_sgd_and_adamw_steps_match_plain_tensors(pool2: RankPool, foreach: bool) -> None:
    assert pool2.run(_optimizers, foreach) == [True, True]
