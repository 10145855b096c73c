# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,var-annotated,assignment"
"""Values and input gradients of MindSpore DTensor ``ops.norm`` and ``ops.dense`` on 4 mccl ranks
against one-process MindSpore, the ops where gradients were silently wrong or the op did not run:
``ops.norm`` (its ReduceSum primitive takes a nested axis list; ``ops.norm(x, p, dim)`` is the
LpNorm primitive) and ``ops.dense`` with every layout of input, weight and bias.

Generated cases are seeded and counted; ranks start once for the module."""

from __future__ import annotations

import numpy as np
import pytest
from ms_gradient_cases import MESHES, compare, random_placements, rel_err, slice_of

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})


# ---------------------------------------------------------------- norm and dense
def _norm_cases(rank, world, mesh_shape):
    from mindspore import ops

    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rs = np.random.RandomState(300 + len(mesh_shape))
    fns = [
        ("ops.norm(x)", lambda t: ops.norm(t)),
        ("x.norm()", lambda t: t.norm()),
        ("ops.norm(x, dim=0)", lambda t: ops.norm(t, dim=0)),
        ("ops.norm(x, 3.0, dim=1, keepdim=True)", lambda t: ops.norm(t, 3.0, dim=1, keepdim=True)),
        ("ops.norm(x, 2, 1) (LpNorm)", lambda t: ops.norm(t, 2, 1)),
        ("ops.norm(x, 'fro')", lambda t: ops.norm(t, "fro")),
    ]
    wrong, n = [], 0
    for _ in range(8):
        A = rs.randn(8, 4).astype(np.float32)
        pl = random_placements(rs, 2, mesh_shape)
        for name, f in fns:
            try:
                v, g = compare(mesh, pl, A, f, lambda shape: rs.randn(*shape))
            except Exception as e:  # noqa: BLE001 -- a raise is one more failure to report
                wrong.append((name, str(pl), f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                continue
            n += 1
            if v > 1 or g > 1:
                wrong.append((name, str(pl), round(v, 2), round(g, 2)))
    return n, wrong


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_norm_values_and_gradients_match_one_process(pool, mesh_shape):
    results = pool.run(_norm_cases, mesh_shape)
    for rank, (n, wrong) in enumerate(results):
        assert not wrong, f"rank {rank}: {wrong[:6]}"
        assert n == 48
    print(f"ops.norm on mesh {mesh_shape}: {results[0][0]} generated cases x 4 ranks match one process")


def _dense_cases(rank, world, mesh_shape):
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    rs = np.random.RandomState(400 + len(mesh_shape))
    n, wrong = 0, []
    for xshape in ((8, 8), (4, 4, 8), (8,)):
        A = rs.randn(*xshape).astype(np.float32)
        W = rs.randn(12, 8).astype(np.float32)
        B = rs.randn(12).astype(np.float32)
        G = rs.randn(*(xshape[:-1] + (12,))).astype(np.float32)
        x_layouts = [Replicate()] + [Shard(d) for d in range(len(xshape))]
        for _ in range(12):
            xp = [x_layouts[rs.randint(len(x_layouts))] for _ in mesh_shape]
            wp = [[Replicate(), Shard(0), Shard(1)][rs.randint(3)] for _ in mesh_shape]
            bp = [[Replicate(), Shard(0)][rs.randint(2)] for _ in mesh_shape]
            with_bias = bool(rs.rand() < 0.8)
            f = (lambda x, w, b: ops.dense(x, w, b)) if with_bias else (lambda x, w, b: ops.dense(x, w))
            locs = [Tensor(slice_of(a, p, mesh_shape, coord)) for a, p in ((A, xp), (W, wp), (B, bp))]

            def dtensor_f(xl, wl, bl, xp=xp, wp=wp, bp=bp, f=f):
                out = f(DTensor.from_local(xl, mesh, xp), DTensor.from_local(wl, mesh, wp),
                        DTensor.from_local(bl, mesh, bp))
                return out.full_tensor()

            case = (xshape, str(xp), str(wp), str(bp) if with_bias else "no bias")
            # value and the gradients of input, weight and bias from one forward per side
            try:
                got, pull_back = ms.vjp(dtensor_f, *locs)
                grads = pull_back(Tensor(G))
            except Exception as e:  # noqa: BLE001 -- a raise is one more failure to report
                wrong.append((*case, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                continue
            got = got.asnumpy()
            want, ref_pull_back = ms.vjp(f, Tensor(A), Tensor(W), Tensor(B))
            want, want_grads = want.asnumpy(), ref_pull_back(Tensor(G))
            errs = [rel_err(got, want)]
            for g, wg, p in zip(grads, want_grads, (xp, wp, bp)):
                errs.append(rel_err(g.asnumpy(), slice_of(wg.asnumpy(), p, mesh_shape, coord)))
            n += 1
            if max(errs) > 1:
                wrong.append((*case, [round(e, 2) for e in errs]))
    return n, wrong


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_dense_with_every_layout_of_input_weight_and_bias(pool, mesh_shape):
    results = pool.run(_dense_cases, mesh_shape)
    for rank, (n, wrong) in enumerate(results):
        assert not wrong, f"rank {rank}: {wrong[:6]}"
        assert n == 36
    print(f"ops.dense on mesh {mesh_shape}: {results[0][0]} generated layouts x 4 ranks match one process "
          f"(values and the gradients of input, weight and bias)")
