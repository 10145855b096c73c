# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,func-returns-value"
"""MindSpore DTensor on 4 CPU ranks: every redistribution between Shard/Replicate/Partial layouts on
a 1-D mesh of 4 (the world group: MindSpore's native collectives) and a 2x2 mesh (subgroups: the
composed ones), checked for values, input gradients and the number of collectives the planner
promised; distribute_tensor from a source rank or not; from_local's shape check; distribute_module.
The four ranks and MindSpore's scheduler start once for the module."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

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
    from hp_dtensor.redistribute_planner import plan_redistribute

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
    return from_source, local_slices, shape_error, (cell.weight.placements, tuple(y.shape), seen)


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
    for rank, (from_source, local_slices, shape_error, module) in enumerate(pool.run(_distribute_and_check)):
        r0, r1 = divmod(rank, 2)
        np.testing.assert_array_equal(from_source[0], np.split(np.split(A, 2, 0)[r0], 2, 1)[r1])
        assert from_source[1] == {"broadcast": 2}  # one per mesh dim, from group-rank 0
        np.testing.assert_array_equal(local_slices[0], np.split(A, 2, 0)[r0])
        assert local_slices[1] == 0  # src_data_rank=None: every rank slices its own copy
        assert "local shards differ" in shape_error and "rank 3: (3, 4)" in shape_error
        placements, y_shape, seen = module
        assert placements == (Replicate(), Replicate()) and y_shape == (3, 2)
        assert seen == [(Replicate(), Replicate())]
