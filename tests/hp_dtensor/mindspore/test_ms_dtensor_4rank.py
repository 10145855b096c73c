# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,func-returns-value,var-annotated,assignment,call-arg"
"""MindSpore DTensor on 4 CPU ranks: every redistribution between Shard/Replicate/Partial layouts on
a 1-D mesh of 4 (the world group: MindSpore's native collectives) and a 2x2 mesh (subgroups: the
composed ones), checked for values, input gradients and the number of collectives the planner
promised; distribute_tensor from a source rank or not; from_local's shape check; distribute_module.
The four ranks and MindSpore's scheduler start once for the module."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest
from ms_gradient_cases import slice_of

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(4, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
SHAPE = (4, 8)


def _A():
    return np.random.RandomState(0).randn(*SHAPE).astype(np.float32)


def _D():
    return np.random.RandomState(1).randn(*SHAPE).astype(np.float32)


def _local_of(value, placements, mesh_shape, coord, D):
    """This rank's local data for ``value`` laid out by ``placements`` (Partial terms reduce back
    to the value exactly enough: their spread sums, averages or maxes to zero)."""
    out = value
    d = D
    for k, p in enumerate(placements):
        n, r = mesh_shape[k], coord[k]
        if p.is_shard():
            out = np.split(out, n, axis=p.dim)[r]
            d = np.split(d, n, axis=p.dim)[r]
        elif p.is_partial():
            spread = (r - (n - 1) / 2.0) * d
            out = {"sum": out / n + spread, "avg": out + spread,
                   "max": out - r * np.abs(d), "min": out + r * np.abs(d)}[p.reduce_op]
    return out.astype(np.float32)


def _grad_of(G, placements, mesh_shape, coord):
    """Expected local gradient of a value with ``placements`` when the loss is sum(full * G):
    torch.distributed.tensor's convention, the global gradient with Partial read as Replicate
    (so a Partial("avg") term gets G, not G/n)."""
    g = G
    for k, p in enumerate(placements):
        if p.is_shard():
            g = np.split(g, mesh_shape[k], axis=p.dim)[coord[k]]
    return g


def _layouts(ndim_mesh):
    from hp_dtensor import Partial, Replicate, Shard

    if ndim_mesh == 1:
        return [(p,) for p in (Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"))]
    return list(itertools.product((Shard(0), Shard(1), Replicate(), Partial("sum")), repeat=2))


def _pairs(mesh_shape):
    layouts = _layouts(len(mesh_shape))
    pairs = [(a, b) for a in layouts for b in layouts if a != b]
    if len(mesh_shape) == 2:
        pairs = random.Random(7).sample(pairs, 60)
    return pairs


def _redistribute_cases(rank, world, mesh_shape):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import CommDebugMode, DTensor, init_device_mesh
    from hp_dtensor.redistribute.planner import plan_redistribute

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    A, D = _A(), _D()
    G = np.random.RandomState(2).randn(*SHAPE).astype(np.float32)
    checked = 0
    for src, dst in _pairs(mesh_shape):
        local = Tensor(_local_of(A, src, mesh_shape, coord, D))
        with CommDebugMode() as comm:
            out = DTensor.from_local(local, mesh, src).redistribute(mesh, dst)
        expected_n = len(plan_redistribute(mesh.shape, SHAPE, src, dst).collectives())
        assert comm.get_total_counts() == expected_n, (src, dst, comm.get_comm_counts(), expected_n)
        assert out.placements == dst and out.shape == SHAPE
        np.testing.assert_allclose(out.full_tensor().asnumpy(), A, rtol=1e-5, atol=1e-5, err_msg=f"{src}->{dst}")
        if not any(p.is_partial() for p in dst):
            want = _local_of(A, dst, mesh_shape, coord, D)
            np.testing.assert_allclose(out.to_local().asnumpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"{src}->{dst}")
        if not any(p.is_partial() and p.reduce_op in ("max", "min") for p in src + dst):

            def loss(x, src=src, dst=dst):
                return (DTensor.from_local(x, mesh, src).redistribute(mesh, dst).full_tensor() * Tensor(G)).sum()

            grad = ms.grad(loss, 0)(local).asnumpy()
            np.testing.assert_allclose(grad, _grad_of(G, src, mesh_shape, coord), rtol=1e-5, atol=1e-5,
                                       err_msg=f"grad {src}->{dst}")
        checked += 1
    return checked


def _shared_value_gradient(rank, world, partial_first):
    """A gathered value used by a column-parallel matmul (behind a reshape: its gradient comes back
    as per-rank terms) and by replicated math plus to_local (whole gradients), in either order:
    the gradient of the original shard is exact, and the terms are reduced once."""
    import mindspore as ms
    from mindspore import Tensor, mint

    from hp_dtensor import CommDebugMode, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    A = _A()
    Wt = np.random.RandomState(3).randn(8, 4).astype(np.float32)
    G1 = np.random.RandomState(4).randn(4, 4).astype(np.float32)
    w = distribute_tensor(Tensor(Wt), mesh, [Shard(1)], src_data_rank=None)
    g1 = Tensor(np.split(G1, world, 1)[rank])

    def loss(xl):
        x = DTensor.from_local(xl, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])

        def column():
            return (mint.matmul(x.reshape(4, 8), w).to_local() * g1).sum()

        def whole():
            return (x * 2.0).sum().to_local() + x.to_local()[0, 0]

        return column() + whole() if partial_first else whole() + column()

    with CommDebugMode() as comm:
        grad = ms.grad(loss, 0)(Tensor(np.split(A, world, 0)[rank])).asnumpy()
    full = G1 @ Wt.T + 2.0
    full[0, 0] += 1.0
    return grad, np.split(full, world, 0)[rank], comm.get_comm_counts()


def _distribute_and_check(rank, world):
    from mindspore import Tensor, nn

    from hp_dtensor import (
        CommDebugMode,
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh("cpu", (2, 2))
    A = _A()
    mine = A if rank == 0 else np.zeros_like(A)
    with CommDebugMode() as comm:
        dt = distribute_tensor(Tensor(mine), mesh, [Shard(0), Shard(1)])
    from_source = (dt.to_local().asnumpy(), comm.get_comm_counts())
    with CommDebugMode() as comm:
        dt2 = distribute_tensor(Tensor(A), mesh, [Shard(0), Replicate()], src_data_rank=None)
    local_slices = (dt2.to_local().asnumpy(), comm.get_total_counts())

    uneven = Tensor(np.ones((2 + (rank == 3), 4), np.float32))
    try:
        DTensor.from_local(uneven, mesh, [Shard(0), Replicate()], run_check=True)
        shape_error = ""
    except ValueError as e:
        shape_error = str(e)

    cell = nn.Dense(4, 2)
    seen = []
    distribute_module(cell, mesh, None,
                      lambda m, inputs, mesh_: (DTensor.from_local(inputs[0], mesh_, [Replicate(), Replicate()]),),
                      lambda m, out, mesh_: seen.append(out.placements) or out.to_local())
    y = cell(Tensor(np.ones((3, 4), np.float32)))

    class Gather(nn.Cell):
        def construct(self, x):
            return x.redistribute(x.device_mesh, [Replicate(), Replicate()])

    # a collective is attributed to the innermost cell whose forward issued it
    model = nn.SequentialCell([nn.Identity(), Gather()])
    comm = CommDebugMode()
    comm.track_module(model)
    with comm:
        model(dt2)
        dt2.full_tensor()  # outside any cell
    by_cell = (comm.get_comm_counts_by_module(), comm.get_comm_counts())
    return from_source, local_slices, shape_error, (cell.weight.placements, tuple(y.shape), seen), by_cell


def test_redistribute_all_layouts_on_the_world_group(pool):
    assert pool.run(_redistribute_cases, (4,)) == [30] * 4


def test_redistribute_on_a_2x2_mesh_uses_composed_subgroup_collectives(pool):
    assert pool.run(_redistribute_cases, (2, 2)) == [60] * 4


@pytest.mark.parametrize("partial_first", [True, False])
def test_gradient_of_a_gathered_value_with_mixed_consumers(pool, partial_first):
    for grad, want, counts in pool.run(_shared_value_gradient, partial_first):
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
        # forward all_gather; backward one reduce_scatter (terms first) or, when a whole-gradient
        # consumer decided first, an all_reduce for the matmul's terms then a local chunk.
        assert counts == ({"all_gather": 1, "reduce_scatter": 1} if partial_first
                          else {"all_gather": 1, "all_reduce": 1}), counts


def test_distribute_tensor_from_local_and_distribute_module(pool):
    from hp_dtensor import Replicate

    A = _A()
    for rank, (from_source, local_slices, shape_error, module, by_cell) in enumerate(pool.run(_distribute_and_check)):
        r0, r1 = divmod(rank, 2)
        np.testing.assert_array_equal(from_source[0], np.split(np.split(A, 2, 0)[r0], 2, 1)[r1])
        assert from_source[1] == {"broadcast": 2}  # one per mesh dim, from group-rank 0
        np.testing.assert_array_equal(local_slices[0], np.split(A, 2, 0)[r0])
        assert local_slices[1] == 0  # src_data_rank=None: every rank slices its own copy
        assert "local shape differs" in shape_error and "rank 3: (3, 4)" in shape_error
        placements, y_shape, seen = module
        assert placements == (Replicate(), Replicate()) and y_shape == (3, 2)
        assert seen == [(Replicate(), Replicate())]
        assert by_cell == ({"1": {"all_gather": 1}}, {"all_gather": 2}), by_cell


# ---------------------------------------------------------------- uneven (torch.chunk-style) shards
# per mesh shape; HP_MS_UNEVEN_CASES=400 for a longer local run
UNEVEN_CASES = int(os.environ.get("HP_MS_UNEVEN_CASES", "40"))


def _chunk_np(a, placements, mesh_shape, coord):
    """This rank's torch.chunk-style block of ``a`` (Shard placements only; others keep it whole)."""
    from hp_dtensor.layout.shard_geometry import chunk_size_and_offset

    for k, p in enumerate(placements):
        if p.is_shard():
            length, start = chunk_size_and_offset(a.shape[p.dim], mesh_shape[k], coord[k])
            a = np.take(a, np.arange(start, start + length), axis=p.dim)
    return np.ascontiguousarray(a)


def _uneven_local(A, D, placements, mesh_shape, coord):
    """Local data of a value A: Partial terms (spread summing/averaging/maxing back to A) first,
    then the chunk of every Shard."""
    out = A
    for k, p in enumerate(placements):
        if p.is_partial():
            n, r = mesh_shape[k], coord[k]
            spread = (r - (n - 1) / 2.0) * D
            out = {"sum": out / n + spread, "avg": out + spread, "max": out - r * np.abs(D)}[p.reduce_op]
    return _chunk_np(out.astype(np.float32), placements, mesh_shape, coord)


def _uneven_specs(mesh_shape, n_cases, seed):
    """Seeded random (global shape, src, dst) with at least one uneven Shard among src/dst."""
    from hp_dtensor import Partial, Replicate, Shard
    from hp_dtensor.layout.shard_geometry import is_even

    rnd = random.Random(seed)
    out = []
    while len(out) < n_cases:
        shape = tuple(rnd.randint(1, 9) for _ in range(rnd.randint(1, 3)))
        choices = [Shard(d) for d in range(len(shape))] + [Replicate(), Partial("sum"), Partial("avg"), Partial("max")]
        src = tuple(rnd.choice(choices) for _ in mesh_shape)
        dst = tuple(rnd.choice(choices) for _ in mesh_shape)
        kinds = {p.reduce_op for p in src + dst if p.is_partial()}
        if src == dst or len(kinds) > 1 or kinds == {"avg", "max"}:
            continue  # mixed reduce ops are refused (tested elsewhere)
        if is_even(shape, mesh_shape, src) and is_even(shape, mesh_shape, dst):
            continue
        out.append((shape, src, dst))
    return out


def _uneven_redistribute_cases(rank, world, mesh_shape, n_cases):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, distribute_tensor, init_device_mesh
    from hp_dtensor.layout.shard_geometry import is_even

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    stats = {"cases": 0, "uneven": 0, "zero_size_shards": 0, "grads": 0, "mismatches": []}
    for i, (shape, src, dst) in enumerate(_uneven_specs(mesh_shape, n_cases, 11 + len(mesh_shape))):
        rs = np.random.RandomState(100 + i)
        A = rs.randn(*shape).astype(np.float32)
        D = rs.randn(*shape).astype(np.float32)
        G = rs.randn(*shape).astype(np.float32)
        local = Tensor(_uneven_local(A, D, src, mesh_shape, coord))
        stats["cases"] += 1
        stats["uneven"] += not (is_even(shape, mesh_shape, src) and is_even(shape, mesh_shape, dst))
        try:
            x = DTensor.from_local(local, mesh, src, shape=shape)
            out = x.redistribute(mesh, dst)
            got_local = out.to_local().asnumpy()
            stats["zero_size_shards"] += got_local.size == 0 or local.size == 0
            ok = out.placements == dst and tuple(out.shape) == shape
            ok = ok and np.allclose(out.full_tensor().asnumpy(), A, rtol=1e-5, atol=1e-5)
            if not any(p.is_partial() for p in dst):
                want = _chunk_np(A, dst, mesh_shape, coord)
                ok = ok and got_local.shape == want.shape and np.allclose(got_local, want, rtol=1e-5, atol=1e-5)
            if not any(p.is_partial() and p.reduce_op == "max" for p in src + dst):

                def loss(xl, src=src, dst=dst, shape=shape, G=G):
                    y = DTensor.from_local(xl, mesh, src, shape=shape).redistribute(mesh, dst)
                    return (y.full_tensor() * Tensor(G)).sum()

                grad = ms.grad(loss, 0)(local).asnumpy()
                want_g = _chunk_np(G, src, mesh_shape, coord)  # Partial terms get the global gradient
                ok = ok and grad.shape == want_g.shape and np.allclose(grad, want_g, rtol=1e-5, atol=1e-5)
                stats["grads"] += 1
            if not ok:
                stats["mismatches"].append((shape, str(src), str(dst)))
        except Exception as e:  # noqa: BLE001 -- a raise is one more wrong answer to report
            stats["mismatches"].append((shape, str(src), str(dst), f"{type(e).__name__}: {str(e)[:200]}"))
    # distribute_tensor from rank 0 (the others pass zeros) onto uneven layouts, zero-size shards included
    for shape, pl in (((5, 3), "S0"), ((2, 7), "S0S1"), ((3, 2, 5), "S2S0"), ((1, 6), "S0R"), ((6,), "S0S0")):
        from hp_dtensor import Replicate, Shard

        placements = tuple(Shard(int(c)) for c in pl[1::2]) if "R" not in pl else (Shard(0), Replicate())
        placements = placements[: len(mesh_shape)] if len(placements) >= len(mesh_shape) else placements + (
            Replicate(),) * (len(mesh_shape) - len(placements))
        A = np.random.RandomState(7).randn(*shape).astype(np.float32)
        mine = A if rank == 0 else np.zeros_like(A)
        stats["cases"] += 1
        try:
            dt = distribute_tensor(Tensor(mine), mesh, placements)
            want = _chunk_np(A, placements, mesh_shape, coord)
            got = dt.to_local().asnumpy()
            stats["zero_size_shards"] += got.size == 0
            if got.shape != want.shape or not np.array_equal(got, want) or not np.array_equal(
                    dt.full_tensor().asnumpy(), A):
                stats["mismatches"].append(("distribute", shape, str(placements)))
        except Exception as e:  # noqa: BLE001
            stats["mismatches"].append(("distribute", shape, str(placements), f"{type(e).__name__}: {str(e)[:200]}"))
    return stats


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_uneven_redistribute_matches_one_process(pool, mesh_shape):
    """Seeded random uneven shapes/placements: local shards are the torch.chunk blocks of the
    one-process value, full_tensor is the value, input gradients are torch's convention."""
    results = pool.run(_uneven_redistribute_cases, mesh_shape, UNEVEN_CASES)
    s = results[0]
    print(f"uneven redistribute on mesh {mesh_shape}: {s['cases']} cases per rank ({s['uneven']} uneven, "
          f"{s['grads']} with gradients) x 4 ranks, {sum(r['zero_size_shards'] for r in results)} rank-cases "
          f"with a zero-size shard, mismatches: {sum(len(r['mismatches']) for r in results)}")
    for rank, r in enumerate(results):
        assert not r["mismatches"], f"rank {rank}: {r['mismatches'][:5]}"
    assert s["cases"] >= UNEVEN_CASES


def _uneven_api_cases(rank, world):
    """from_local(shape=, run_check=True) on uneven shards; pointwise ops keep the uneven layout,
    other ops see it as Replicate on the uneven dim; values against one-process MindSpore."""
    from mindspore import Tensor, mint, ops

    from hp_dtensor import CommDebugMode, DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    A = np.random.RandomState(31).randn(7, 3).astype(np.float32)
    B = np.random.RandomState(32).randn(7, 3).astype(np.float32)
    pl = (Shard(0),)
    xa = _chunk_np(A, pl, (world,), (rank,))
    x = DTensor.from_local(Tensor(xa), mesh, pl, shape=(7, 3), run_check=True)
    y = DTensor.from_local(Tensor(_chunk_np(B, pl, (world,), (rank,))), mesh, pl, shape=(7, 3))
    out = {"local rows": xa.shape[0]}
    X, Y = Tensor(A), Tensor(B)
    pointwise = {
        "x * y + 1": lambda a, b: a * b + 1, "ops.add(x, 2.5)": lambda a, b: ops.add(a, 2.5),
        "relu(x) - y": lambda a, b: ops.relu(a) - b, "mint.exp(x) / 2": lambda a, b: mint.exp(a) / 2,
    }
    for name, f in pointwise.items():
        with CommDebugMode() as comm:
            r = f(x, y)
        out[name] = (tuple(r.placements), tuple(r.shape), comm.get_total_counts(),
                     float(np.max(np.abs(r.full_tensor().asnumpy() - f(X, Y).asnumpy()))))
    others = {"x.sum(0)": lambda a: a.sum(0), "x.sum()": lambda a: a.sum(), "x.mean(1)": lambda a: a.mean(1),
              "softmax(x, 0)": lambda a: ops.softmax(a, 0), "x.T": lambda a: a.transpose(1, 0)}
    for name, op in others.items():
        r = op(x)
        out[name] = (tuple(r.shape), float(np.max(np.abs(r.full_tensor().asnumpy() - op(X).asnumpy()))))
    try:
        bad = Tensor(np.ones((2, 3), np.float32))  # every rank claims 2 rows of 7: wrong on ranks 2 and 3
        DTensor.from_local(bad, mesh, pl, shape=(7, 3), run_check=True)
        out["bad shape"] = "accepted"
    except ValueError as e:
        out["bad shape"] = str(e)
    rep = DTensor.from_local(Tensor(A), mesh, [Replicate()]).redistribute(mesh, pl)
    out["R->S0 local rows"] = rep.to_local().shape[0]
    return out


def test_uneven_from_local_pointwise_and_other_ops(pool):
    results = pool.run(_uneven_api_cases)
    from hp_dtensor import Shard

    assert [r["local rows"] for r in results] == [2, 2, 2, 1]
    assert [r["R->S0 local rows"] for r in results] == [2, 2, 2, 1]
    for r in results:
        for name in ("x * y + 1", "ops.add(x, 2.5)", "relu(x) - y", "mint.exp(x) / 2"):
            placements, shape, n_comm, err = r[name]
            # pointwise on uneven shards: shard by shard, no communication, uneven layout kept
            assert placements == (Shard(0),) and shape == (7, 3) and n_comm == 0 and err < 1e-5, (name, r[name])
        for name in ("x.sum(0)", "x.sum()", "x.mean(1)", "softmax(x, 0)", "x.T"):
            assert r[name][1] < 1e-5, (name, r[name])
        assert "do not tile shape=(7, 3)" in r["bad shape"] and "rank 3: (2, 3) (want (1, 3))" in r["bad shape"], r[
            "bad shape"]
    assert all(r["bad shape"] == results[0]["bad shape"] for r in results)  # the same error on every rank


# ---------------------------------------------------------------- to_local of a DTensor Parameter
def _parameter_to_local_gradients(rank, world):
    """A DTensor ``Parameter``'s ``to_local()`` used in plain local compute: its gradient is the
    local compute's, for every layout on a 2x2 mesh (it was silently zero)."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh_shape = (2, 2)
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    rs = np.random.RandomState(7)
    W = rs.randn(4, 8).astype(np.float32)
    C = rs.randn(4, 8).astype(np.float32)  # the same weights of the local compute on every rank
    checked, worst = 0, 0.0
    for placements in ([Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(1)],
                       [Shard(0), Shard(1)], [Shard(1), Shard(1)]):
        local_w = slice_of(W, placements, mesh_shape, coord)
        local_c = Tensor(slice_of(C, placements, mesh_shape, coord))
        p = ms.Parameter(DTensor.from_local(Tensor(local_w), mesh, placements), name="w", requires_grad=True)
        for through_op in (False, True):
            def loss(p=p, local_c=local_c, through_op=through_op):
                return (((p * 1.0) if through_op else p).to_local() * local_c).sum()

            (g,) = ms.grad(loss, grad_position=None, weights=[p])()
            g = g.to_local() if isinstance(g, DTensor) else g
            worst = max(worst, float(np.abs(g.asnumpy() - local_c.asnumpy()).max()))
            checked += 1
    return checked, worst


def test_parameter_to_local_carries_its_gradient(pool):
    results = pool.run(_parameter_to_local_gradients)
    assert all(n == 10 for n, _ in results), results
    assert max(w for _, w in results) <= 1e-6, results
    print(f"to_local of a DTensor Parameter: {results[0][0]} layouts x ways x 4 ranks, gradient = the local "
          f"compute's (max error {max(w for _, w in results):.1e})")
