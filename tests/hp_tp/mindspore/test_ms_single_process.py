# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,call-overload,attr-defined,func-returns-value,arg-type,index"
"""MindSpore, one process (a world of one): everything that needs no communication -- backend
selection, DTensor API and its errors on a 1-rank mesh, style construction and geometry, hooks,
and every fail-closed row (A1-A12 of docs/tensor-parallel.md where they apply to MindSpore)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import hp_dtensor
from hp_dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)
from hp_dtensor.platform import current
from hp_tp import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

assert os.environ.get("HYPER_PARALLEL_PLATFORM") == "mindspore", "run with HYPER_PARALLEL_PLATFORM=mindspore"


@pytest.fixture(scope="module")
def mesh():
    from hp_dtensor.platform import current

    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    current().destroy()  # no world of one left behind for the next file of a batched pytest process


def _t(a):
    return Tensor(np.asarray(a, np.float32))


def _dense(i=6, o=8, seed=0):
    rs = np.random.RandomState(seed)
    d = nn.Dense(i, o)
    d.weight.set_data(_t(rs.randn(o, i)))
    d.bias.set_data(_t(rs.randn(o)))
    return d


class TwoInputs(nn.Cell):
    def construct(self, x, y):
        return x + y


# ------------------------------------------------------------------ backend
def test_backend_is_mindspore():
    assert current().NAME == "mindspore"
    assert issubclass(hp_dtensor.DTensor, ms.Tensor)


def test_unknown_platform_name_is_rejected():
    code = "import hp_dtensor; hp_dtensor.DTensor"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HYPER_PARALLEL_PLATFORM": "jax"})
    assert out.returncode != 0 and "HYPER_PARALLEL_PLATFORM='jax'" in out.stderr


# ------------------------------------------------------------------ DTensor on a 1-rank mesh
def test_dtensor_api_round_trip(mesh):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    dt = distribute_tensor(_t(a), mesh, [Shard(1)])
    assert isinstance(dt, DTensor) and dt.placements == (Shard(1),) and dt.shape == (3, 4)
    np.testing.assert_array_equal(dt.to_local().asnumpy(), a)
    rep = dt.redistribute(mesh, [Replicate()])
    np.testing.assert_array_equal(rep.full_tensor().asnumpy(), a)
    back = DTensor.from_local(_t(a), mesh, [Partial()])
    np.testing.assert_array_equal(back.full_tensor().asnumpy(), a)
    np.testing.assert_allclose((dt * 2.0 + dt).to_local().asnumpy(), a * 3.0)
    np.testing.assert_allclose(dt.sum().full_tensor().asnumpy(), a.sum())


def test_dtensor_errors(mesh):
    dt = distribute_tensor(_t(np.ones((2, 2))), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="out of range"):
        distribute_tensor(_t(np.ones((2, 2))), mesh, [Shard(2)])
    with pytest.raises(ValueError, match="use .redistribute"):
        distribute_tensor(dt, mesh, [Replicate()])
    with pytest.raises(ValueError, match="from_local got a DTensor"):
        DTensor.from_local(dt, mesh, [Replicate()])
    with pytest.raises(ValueError, match="needs placements"):
        dt.redistribute(mesh)
    with pytest.raises(RuntimeError, match="mix of mindspore.Tensor"):
        _ = dt + _t(np.ones((2, 2)))
    with pytest.raises(NotImplementedError, match="to_local"):
        _ = dt[0]
    with pytest.raises(RuntimeError, match="ambiguous"):
        dt.asnumpy()


def test_op_without_rule_replicates_and_warns_once(mesh):
    dt = distribute_tensor(_t(np.arange(4.0)), mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = ms.ops.cumsum(dt, 0)
        ms.ops.cumsum(dt, 0)
    np.testing.assert_allclose(out.to_local().asnumpy(), np.cumsum(np.arange(4.0)))
    msgs = [str(x.message) for x in w if "no sharding rule" in str(x.message)]
    assert len(msgs) == 1 and "CumSum" in msgs[0], msgs


# ------------------------------------------------------------------ geometry, hooks, compatibility
def test_B1_B2_B5_B6_placements_on_mindspore_cells(mesh):
    col = parallelize_module(_dense(), mesh, ColwiseParallel())
    assert col.weight.placements == (Shard(0),) and col.bias.placements == (Shard(0),)
    row = parallelize_module(_dense(), mesh, RowwiseParallel())
    assert row.weight.placements == (Shard(1),) and row.bias.placements == (Replicate(),)
    emb = parallelize_module(nn.Embedding(10, 4), mesh, ColwiseParallel())
    assert emb.embedding_table.placements == (Shard(1),)
    norm = parallelize_module(nn.LayerNorm((8,)), mesh, SequenceParallel())
    assert norm.gamma.placements == (Replicate(),) and norm.beta.placements == (Replicate(),)
    nop = parallelize_module(_dense(), mesh, NoParallel())
    assert nop.weight.placements == (Replicate(),)
    assert col.weight.name == "weight" and isinstance(col.weight, ms.Parameter)


def test_plain_dense_unchanged_without_a_style():
    d = _dense(seed=3)
    x = np.random.RandomState(4).randn(2, 6).astype(np.float32)
    want = x @ d.weight.asnumpy().T + d.bias.asnumpy()
    np.testing.assert_allclose(d(_t(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_kwargs_pre_hook_and_multi_output_hook(mesh):
    class KW(nn.Cell):
        def construct(self, x, *, y=None):
            return x, y

    seen = []
    cell = KW()
    current().register_forward_pre_hook(cell, lambda m, a, k: (a, {**k, "y": k["y"] * 2.0}), with_kwargs=True)
    current().register_forward_hook(cell, lambda m, a, out: seen.append(len(out)) or (out[1], out[0]))
    a, b = cell(_t([1.0]), y=_t([3.0]))
    assert seen == [2] and a.asnumpy()[0] == 6.0 and b.asnumpy()[0] == 1.0


def test_prepare_module_input_kwargs_and_none_slot(mesh):
    cell = parallelize_module(TwoInputs(), mesh, PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None), use_local_output=True))
    out = cell(_t([1.0, 2.0]), _t([3.0, 4.0]))
    np.testing.assert_allclose(out.asnumpy(), [4.0, 6.0])


# ------------------------------------------------------------------ fail closed (rows A1-A12)
def test_A1_parallel_style_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        ParallelStyle()  # type: ignore[abstract]


def test_A2_two_dim_mesh_is_rejected():
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r'device_mesh\["tp"\]'):
        parallelize_module(_dense(), mesh2, ColwiseParallel())


def test_A3_plan_types(mesh):
    with pytest.raises(TypeError):
        parallelize_module(_dense(), mesh, [ColwiseParallel()])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parallelize_module(_dense(), mesh, {"x": "colwise"})  # type: ignore[dict-item]


@pytest.mark.parametrize("fqn", ["", "a..b"])
def test_A4_bad_fqn(mesh, fqn):
    with pytest.raises(ValueError, match="FQN"):
        parallelize_module(_dense(), mesh, {fqn: ColwiseParallel()})


def test_A5_unmatched_path_warns_and_leaves_module(mesh):
    d = _dense()
    with pytest.warns(UserWarning, match="matched no submodule"):
        parallelize_module(d, mesh, {"nope": ColwiseParallel()})
    assert not isinstance(d.weight, DTensor)


@pytest.mark.parametrize("style", [ColwiseParallel, RowwiseParallel])
@pytest.mark.parametrize("make", [lambda: nn.LayerNorm((4,)), nn.ReLU, TwoInputs])
def test_A6_col_row_reject_other_cells(mesh, style, make):
    cell = make()
    with pytest.raises(NotImplementedError, match="Linear and Embedding"):
        parallelize_module(cell, mesh, style())
    assert not any(isinstance(p, DTensor) for p in cell.get_parameters())


def test_A7_prepare_layout_lengths():
    with pytest.raises(AssertionError):
        PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(), Replicate()))
    with pytest.raises(AssertionError):
        PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(),))


def test_A8_prepare_forward_arity(mesh):
    cell = parallelize_module(TwoInputs(), mesh, PrepareModuleInput(
        input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)))
    with pytest.raises(ValueError, match="same length"):
        cell(_t([1.0]), _t([2.0]))


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3])
def test_A9_sequence_parallel_input_type(mesh, bad):
    class Id(nn.Cell):
        def construct(self, x):
            return x

    cell = parallelize_module(Id(), mesh, SequenceParallel())
    with pytest.raises(ValueError, match="tensor or DTensor"):
        cell(bad)


def test_A10_rowwise_linear_plain_output(mesh):
    class ConstantDense(nn.Dense):
        def construct(self, x):
            return Tensor(np.zeros((1, 8), np.float32))

    cell = parallelize_module(ConstantDense(6, 8), mesh, RowwiseParallel())
    with pytest.raises(TypeError, match="DTensor"):
        cell(_t(np.ones((1, 6))))


def test_A11_distribute_module_twice(mesh):
    d = _dense()
    parallelize_module(d, mesh, ColwiseParallel())
    with pytest.raises(RuntimeError, match="only once"):
        parallelize_module(d, mesh, ColwiseParallel())
    with pytest.raises(RuntimeError, match="only once"):
        distribute_module(d, mesh)


def test_A12_none_plan_warns_and_returns_module(mesh):
    d = _dense()
    with pytest.warns(UserWarning, match="parallelize_plan=None"):
        assert parallelize_module(d, mesh, None) is d


def test_prepare_module_input_non_tensor_asserts(mesh):
    cell = parallelize_module(TwoInputs(), mesh, PrepareModuleInput(
        input_layouts=(Shard(0), Shard(0)), desired_input_layouts=(Replicate(), Replicate())))
    with pytest.raises(AssertionError, match="expected a tensor"):
        cell(_t([1.0]), 2.0)


def test_update_of_a_dtensor_with_a_plain_tensor_of_another_shape_is_rejected(mesh):
    d = parallelize_module(_dense(), mesh, ColwiseParallel())
    with pytest.raises(RuntimeError, match=r"local shard is \(8, 6\)"):
        ms.ops.assign_sub(d.weight, _t(np.ones((3, 3))))
    ms.ops.assign_sub(d.weight, _t(np.ones((8, 6))))  # the local gradient's shape: allowed


def test_device_and_feature_gaps_fail_loudly(mesh):
    with pytest.raises(RuntimeError, match="already runs MindSpore on CPU"):
        init_device_mesh("npu", (1,))
    with pytest.raises(ValueError, match="not one of"):
        init_device_mesh("cuda", (1,))


def test_npu_mesh_without_ascend_says_so():
    code = "from hp_dtensor import init_device_mesh; init_device_mesh('npu', (1,))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HYPER_PARALLEL_PLATFORM": "mindspore"})
    assert out.returncode != 0 and "needs MindSpore built for Ascend" in out.stderr, out.stderr[-1500:]
