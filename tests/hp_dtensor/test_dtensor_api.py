# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""DTensor API on real gloo ranks: distribute_tensor, from_local, to_local, full_tensor,
redistribute (fuzzed on 1-D and 2x2 meshes, values and gradients), errors and comm counts."""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    from hp_dtensor import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


# ---------------------------------------------------------------- cases run on every rank
def _mesh_api(rank: int, world: int) -> dict[str, Any]:
    from hp_dtensor import get_current_mesh

    mesh = _mesh((2, 2), ("dp", "tp"))
    tp = mesh["tp"]
    with tp:
        current = get_current_mesh()
    return {
        "coord": mesh.get_coordinate(),
        "local_tp": mesh.get_local_rank("tp"),
        "tp_ranks": tp.layout.ranks,
        "tp_ndim": tp.ndim,
        "current_is_tp": current is tp,
        "size": (mesh.size(), mesh.size(0), tp.size()),
        "names": mesh["dp", "tp"].mesh_dim_names,
    }


def _distribute_from_rank0(rank: int, world: int) -> list[Any]:
    import torch

    from hp_dtensor import CommDebugMode, Replicate, Shard, distribute_tensor

    mesh = _mesh((4,))
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    mine = x if rank == 0 else torch.full((8, 4), float("nan"))
    out = []
    for pl in (Shard(0), Replicate(), Shard(1)):
        with CommDebugMode() as comm:
            d = distribute_tensor(mine, mesh, [pl])
        out.append((comm.get_comm_counts(), torch.equal(d.full_tensor(), x), tuple(d.to_local().shape)))
    return out


def _distribute_without_comm(rank: int, world: int) -> list[Any]:
    import torch

    from hp_dtensor import CommDebugMode, Shard, distribute_tensor

    mesh = _mesh((2, 2))
    x = torch.arange(64.0).reshape(8, 8)
    with CommDebugMode() as comm:
        d = distribute_tensor(x, mesh, [Shard(0), Shard(1)], src_data_rank=None)
        meta = distribute_tensor(torch.empty(8, 8, device="meta"), mesh, [Shard(0), Shard(0)])
    c = mesh.get_coordinate()
    expect = x[c[0] * 4 : c[0] * 4 + 4, c[1] * 4 : c[1] * 4 + 4]
    return [
        comm.get_total_counts(),
        torch.equal(d.to_local(), expect),
        meta.to_local().is_meta,
        tuple(meta.to_local().shape),
        tuple(meta.shape),
    ]


def _from_local_and_back(rank: int, world: int) -> list[Any]:
    import torch

    from hp_dtensor import DTensor, Partial, Shard

    mesh = _mesh((4,))
    local = torch.full((2, 3), float(rank), requires_grad=True)
    d = DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    full = d.full_tensor()
    (full * torch.arange(24.0).reshape(8, 3)).sum().backward()
    grad_ok = torch.equal(local.grad, torch.arange(24.0).reshape(8, 3)[2 * rank : 2 * rank + 2])
    p = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    return [tuple(d.shape), full[:, 0].tolist(), grad_ok, p.full_tensor().tolist(), d.placements]


def _from_local_run_check_uneven(rank: int, world: int) -> str:
    import torch

    from hp_dtensor import DTensor, Shard

    mesh = _mesh((4,))
    try:
        DTensor.from_local(torch.zeros(3 if rank == 1 else 2, 4), mesh, [Shard(0)], run_check=True)
    except ValueError as e:
        return str(e)
    return "no error"


def _errors(rank: int, world: int) -> list[str]:
    import torch

    from hp_dtensor import Replicate, Shard, distribute_tensor

    mesh = _mesh((4,))
    sub = _mesh((2, 2), ("a", "b"))["b"]
    msgs = []
    for fn in (
        lambda: distribute_tensor(torch.zeros(6, 4), mesh, [Shard(2)]),
        lambda: distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0), Replicate()]),
        lambda: distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()]).redistribute(sub, [Replicate()]),
        lambda: distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]) + torch.zeros(8, 4),
    ):
        try:
            fn()
            msgs.append("no error")
        except (ValueError, RuntimeError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def _fuzz_redistribute(rank: int, world: int, mesh_shape: tuple[int, ...], examples: int) -> int:
    """Hypothesis draws the same examples on every rank (derandomized), so collectives match."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hp_dtensor import CommDebugMode, Partial, Replicate, Shard, distribute_tensor
    from hp_dtensor.redistribute.planner import plan_redistribute

    mesh = _mesh(mesh_shape)
    pl = st.sampled_from([Replicate(), Partial(), Partial("avg"), Shard(0), Shard(1), Shard(-1)])
    checked = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None)
    @given(
        dims=st.lists(st.sampled_from([4, 8]), min_size=2, max_size=3),
        src=st.lists(pl, min_size=len(mesh_shape), max_size=len(mesh_shape)),
        dst=st.lists(pl, min_size=len(mesh_shape), max_size=len(mesh_shape)),
        seed=st.integers(0, 1000),
    )
    def check(dims: list[int], src: list[Any], dst: list[Any], seed: int) -> None:
        torch.manual_seed(seed)
        x = torch.randn(*dims)
        g = torch.randn(*dims)
        d = distribute_tensor(x, mesh, src, src_data_rank=None).detach().requires_grad_(True)
        with CommDebugMode() as comm:
            y = d.redistribute(mesh, dst)
        plan = plan_redistribute(mesh.shape, tuple(dims), d.placements, y.placements)
        assert comm.get_total_counts() == len(plan.collectives()), (comm.get_comm_counts(), plan)
        torch.testing.assert_close(y.full_tensor(), x, rtol=1e-5, atol=1e-5)
        (y.full_tensor() * g).sum().backward()
        assert d.grad is not None and d.grad.placements == tuple(
            Replicate() if isinstance(p, Partial) else p for p in d.placements
        ), d.grad.placements
        torch.testing.assert_close(d.grad.full_tensor(), g, rtol=1e-5, atol=1e-5)
        checked.append(1)

    check()
    return len(checked)


def _grads_stay_dtensors_and_sgd_updates_shards(rank: int, world: int) -> list[Any]:
    import torch

    from hp_dtensor import Replicate, Shard, distribute_tensor

    mesh = _mesh((4,))
    torch.manual_seed(1)
    w = torch.randn(6, 4)
    w_col = torch.randn(6, 16)
    x = torch.randn(4, 6)
    dw = torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
    dw_col = torch.nn.Parameter(distribute_tensor(w_col, mesh, [Shard(1)]))
    dx = distribute_tensor(x, mesh, [Shard(0)])  # row-sharded activations
    loss = ((dx @ dw) ** 2).sum() + ((dx @ dw_col) ** 2).sum()
    loss.backward()
    ref, ref_col = w.clone().requires_grad_(True), w_col.clone().requires_grad_(True)
    (((x @ ref) ** 2).sum() + ((x @ ref_col) ** 2).sum()).backward()
    out = [type(dw.grad).__name__, dw.grad.placements, dw_col.grad.placements]
    out.append(
        torch.allclose(dw.grad.full_tensor(), ref.grad, atol=1e-4)
        and torch.allclose(dw_col.grad.full_tensor(), ref_col.grad, atol=1e-4)
    )
    opt = torch.optim.SGD([dw, dw_col], lr=0.1)
    opt.step()
    out.append(torch.allclose(dw.full_tensor(), w - 0.1 * ref.grad, atol=1e-5))
    out.append(torch.allclose(dw_col.full_tensor(), w_col - 0.1 * ref_col.grad, atol=1e-5))
    out.append(type(dw).__name__)
    return out


def _distribute_module_once(rank: int, world: int) -> list[Any]:
    import torch

    from hp_dtensor import DTensor, Shard, distribute_module, distribute_tensor

    mesh = _mesh((4,))
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    m[1].register_buffer("stat", torch.ones(8))

    def partition(name: str, sub: Any, mesh: Any) -> None:
        if name == "0":
            sub.weight = torch.nn.Parameter(distribute_tensor(sub.weight.data, mesh, [Shard(0)]))

    distribute_module(m, mesh, partition)
    kinds = {n: (type(p).__name__, p.placements) for n, p in m.named_parameters()}
    kinds["1.stat"] = (type(m[1].stat).__name__, m[1].stat.placements)
    try:
        distribute_module(m, mesh)
        second = "no error"
    except RuntimeError as e:
        second = str(e)
    return [kinds, second, isinstance(m[0].bias, DTensor)]


# ---------------------------------------------------------------- tests
def test_mesh_api_on_2x2(pool4: RankPool) -> None:
    res = pool4.run(_mesh_api)
    assert [r["coord"] for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["local_tp"] for r in res] == [0, 1, 0, 1]
    assert [r["tp_ranks"] for r in res] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert all(r["tp_ndim"] == 1 and r["current_is_tp"] and r["size"] == (4, 2, 2) for r in res)
    assert res[0]["names"] == ("dp", "tp")


def test_distribute_tensor_src_data_rank_0_scatters_rank0_values(pool4: RankPool) -> None:
    for rank_res in pool4.run(_distribute_from_rank0):
        (c_s0, ok_s0, shape_s0), (c_r, ok_r, shape_r), (c_s1, ok_s1, shape_s1) = rank_res
        assert c_s0 == {"scatter": 1} and ok_s0 and shape_s0 == (2, 4)
        assert c_r == {"broadcast": 1} and ok_r and shape_r == (8, 4)
        assert c_s1 == {"scatter": 1} and ok_s1 and shape_s1 == (8, 1)


def test_distribute_tensor_src_none_and_meta_issue_no_collective(pool4: RankPool) -> None:
    for n_comm, ok, is_meta, meta_local, meta_global in pool4.run(_distribute_without_comm):
        assert n_comm == 0 and ok and is_meta
        assert meta_local == (2, 8) and meta_global == (8, 8)


def test_from_local_to_local_full_tensor_are_differentiable(pool4: RankPool) -> None:
    from hp_dtensor import Shard

    for shape, col, grad_ok, partial_sum, placements in pool4.run(_from_local_and_back):
        assert shape == (8, 3) and col == [0, 0, 1, 1, 2, 2, 3, 3]
        assert grad_ok and partial_sum == [4.0, 4.0, 4.0] and placements == (Shard(0),)


def test_from_local_run_check_rejects_unequal_shards(pool4: RankPool) -> None:
    for msg in pool4.run(_from_local_run_check_uneven):
        assert "local shape differs across the mesh" in msg and "rank 1: (3, 4)" in msg and "shape=" in msg


def test_errors_name_the_problem(pool4: RankPool) -> None:
    bad_dim, wrong_len, other_mesh, mixed = pool4.run(_errors)[0]
    assert "Shard(2) is out of range for a tensor with 2 dims" in bad_dim
    assert "2 placements" in wrong_len and "1-D mesh" in wrong_len
    assert other_mesh.startswith("ValueError") and "across meshes" in other_mesh
    assert mixed.startswith("RuntimeError") and "mix of torch.Tensor" in mixed


@pytest.mark.parametrize("mesh_shape,examples", [((4,), 40), ((2, 2), 40)])
def test_redistribute_fuzz_values_grads_and_comm_counts(pool4: RankPool, mesh_shape, examples) -> None:
    assert pool4.run(_fuzz_redistribute, mesh_shape, examples, timeout=240) == [examples] * 4


def test_param_grads_are_dtensors_and_sgd_updates_local_shards(pool4: RankPool) -> None:
    from hp_dtensor import Partial, Shard

    for name, rep_grad, col_grad, grads_ok, rep_step_ok, col_step_ok, param_type in pool4.run(
        _grads_stay_dtensors_and_sgd_updates_shards
    ):
        assert name == "DTensor" and param_type == "DTensor"
        assert rep_grad == (Partial(),)  # Replicate weight under sharded rows: a Partial grad
        # the weight grad is whatever the backward matmul produced (Shard(1) or a Partial that the
        # optimizer step reduce-scatters); the numbers below are what matters
        assert col_grad in ((Shard(1),), (Partial(),))
        assert grads_ok and rep_step_ok and col_step_ok


def test_distribute_module_replicates_leftovers_and_runs_once(pool4: RankPool) -> None:
    from hp_dtensor import Replicate, Shard

    kinds, second, bias_is_dt = pool4.run(_distribute_module_once)[0]
    assert kinds["0.weight"] == ("DTensor", (Shard(0),))
    assert kinds["0.bias"] == ("DTensor", (Replicate(),))
    assert kinds["1.weight"] == ("DTensor", (Replicate(),))
    assert kinds["1.stat"] == ("DTensor", (Replicate(),))
    assert "already applied" in second and bias_is_dt
