# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Test-matrix rows A1-A12 (docs/tensor-parallel.md) and the styles' defaults, on the fake process
group in one process: every bad input raises the listed type with the listed words before anything
is computed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hp_dtensor import Replicate, Shard, init_device_mesh
from hp_dtensor.testing import fake_world
from hp_tp import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@pytest.fixture
def mesh2():
    with fake_world(2, rank=0):
        yield init_device_mesh("cpu", (2,))


def test_defaults_match_rfc_5_2() -> None:
    c = ColwiseParallel()
    assert c.input_layouts == (Replicate(),) and c.output_layouts == (Shard(-1),)
    assert c.desired_input_layouts == (Replicate(),) and c.use_local_output and c.src_data_rank == 0
    r = RowwiseParallel()
    assert r.input_layouts == (Shard(-1),) and r.output_layouts == (Replicate(),)
    assert r.desired_input_layouts == (Shard(-1),) and r.use_local_output and r.reduce_dtype is None
    s = SequenceParallel()
    assert s.sequence_dim == 1 and s.use_local_output is False
    p = PrepareModuleInput()
    assert p.input_layouts is None and p.desired_input_layouts is None and p.use_local_output is False
    o = PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate())
    assert o.use_local_output and o.reduce_dtype is None
    n = NoParallel()
    assert (n.input_layout, n.desired_input_layout, n.output_layout) == (Replicate(),) * 3 and n.use_local_output
    io = PrepareModuleInputOutput(output_layouts=Shard(0), desired_output_layouts=Replicate())
    assert io.prepare_module_input.use_local_output is False and io.prepare_module_output.use_local_output


def test_A1_parallel_style_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        ParallelStyle()  # type: ignore[abstract]


def test_A2_2d_mesh_rejected() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"1D DeviceMesh.*device_mesh\[\"tp\"\]"):
            parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel())


def test_A3_plan_types(mesh2) -> None:
    with pytest.raises(TypeError, match="ParallelStyle or a dict"):
        parallelize_module(nn.Linear(4, 4), mesh2, [ColwiseParallel()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parallelize_plan\['0'\] must be a ParallelStyle"):
        parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh2, {"0": "colwise"})  # type: ignore[dict-item]


@pytest.mark.parametrize("key", ["", "a..b", ".a", "a."])
def test_A4_empty_fqn_atoms(mesh2, key: str) -> None:
    with pytest.raises(ValueError, match="not a valid FQN"):
        parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh2, {key: ColwiseParallel()})


def test_A5_unmatched_path_warns_and_leaves_module(mesh2) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="'missing.proj' matched no submodule"):
        parallelize_module(model, mesh2, {"missing.proj": ColwiseParallel()})
    assert type(model[0].weight) is nn.Parameter and not hasattr(model[0].weight, "placements")


@pytest.mark.parametrize("module", [nn.LayerNorm(4), nn.ReLU(), nn.Conv1d(4, 4, 1)])
@pytest.mark.parametrize("style", [ColwiseParallel, RowwiseParallel])
def test_A6_col_row_only_linear_and_embedding(mesh2, module, style) -> None:
    with pytest.raises(NotImplementedError, match="Linear and Embedding"):
        parallelize_module(module, mesh2, style())


def test_A7_prepare_layout_lengths_checked_at_construction() -> None:
    with pytest.raises(AssertionError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(0), Replicate()), desired_input_layouts=(Replicate(),))
    with pytest.raises(AssertionError, match="should not be None"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(AssertionError, match="same length"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={})
    with pytest.raises(AssertionError, match="same length"):
        PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(),))


class _TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def test_A8_prepare_forward_arity(mesh2) -> None:
    m = parallelize_module(
        _TwoInputs(), mesh2, PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())
    )
    with pytest.raises(ValueError, match="same length"):
        m(torch.ones(2), torch.ones(2))


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3])
def test_A9_sequence_parallel_input_type(mesh2, bad) -> None:
    norm = parallelize_module(nn.LayerNorm(4), mesh2, SequenceParallel(), src_data_rank=None)
    with pytest.raises(ValueError, match="tensor or DTensor"):
        norm(bad)


class _PlainOutputLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # computes on nothing sharded
        return torch.zeros(x.shape[0], self.out_features)


def test_A10_rowwise_linear_plain_output_is_type_error(mesh2) -> None:
    m = parallelize_module(_PlainOutputLinear(4, 3), mesh2, RowwiseParallel(), src_data_rank=None)
    with pytest.raises(TypeError, match="return a DTensor"):
        m(torch.ones(2, 2))


def test_A11_second_distribute_module_is_runtime_error(mesh2) -> None:
    lin = nn.Linear(4, 4)
    ColwiseParallel().apply(lin, mesh2)
    with pytest.raises(RuntimeError, match="already applied"):
        ColwiseParallel().apply(lin, mesh2)


def test_A12_none_plan_warns_and_returns_module(mesh2) -> None:
    lin = nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parallelize_module(lin, mesh2, None) is lin
    assert any("parallelize_plan=None" in str(w.message) for w in caught)
    assert not hasattr(lin.weight, "placements")


def test_prepare_module_input_non_tensor_with_layout_is_assertion(mesh2) -> None:
    m = parallelize_module(
        _TwoInputs(), mesh2,
        PrepareModuleInput(input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), None)),
    )
    with pytest.raises(AssertionError, match="expected a tensor"):
        m(torch.ones(2), 5)


def test_current_mesh_from_context(mesh2) -> None:
    lin = nn.Linear(4, 4)
    with mesh2:
        parallelize_module(lin, parallelize_plan=ColwiseParallel(), src_data_rank=None)
    assert lin.weight.placements == (Shard(0),)


def test_no_mesh_anywhere_is_value_error() -> None:
    with pytest.raises(ValueError, match="needs a device_mesh"):
        parallelize_module(nn.Linear(4, 4), None, ColwiseParallel())


def test_loss_parallel_unsupported_inputs_fail_closed(mesh2) -> None:
    import torch.nn.functional as F

    from hp_dtensor.platform.torch import distribute_tensor
    from hp_tp import loss_parallel

    logits = distribute_tensor(torch.randn(4, 8), mesh2, [Shard(0)], src_data_rank=None)
    target = torch.tensor([1, 2, 3, 4])
    with loss_parallel():
        # sharded on the batch, not the classes: a loss_parallel error, not a generic mixing error
        with pytest.raises(ValueError, match=r"loss_parallel: cross_entropy needs logits sharded on the class dim"):
            F.cross_entropy(logits, target)
