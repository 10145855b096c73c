# mypy: disable-error-code="no-untyped-def,import-not-found,import-untyped"
"""MindSpore, one process: the DTensor API's argument rules are the neutral core's, so MindSpore
refuses what torch refuses (bad ``src_data_rank``, a non-contiguous ``stride``), and
``distribute_tensor`` is the plan from ``Replicate`` run by the plan walker."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from hp_dtensor.api.dtensor_methods import DTensorMethods
from hp_dtensor.platform import current


@pytest.fixture(scope="module")
def mesh():
    yield init_device_mesh("cpu", (1,))
    current().destroy()  # no world of one left behind for the next file of a batched pytest process


def _t(a):
    return Tensor(np.asarray(a, np.float32))


def test_dtensor_uses_the_neutral_methods(mesh) -> None:
    assert issubclass(DTensor, DTensorMethods)
    dt = distribute_tensor(_t(np.arange(6).reshape(2, 3)), mesh, [Shard(1)])
    assert dt.placements == (Shard(1),) and dt.device_mesh is mesh
    np.testing.assert_array_equal(dt.full_tensor().asnumpy(), np.arange(6).reshape(2, 3))
    assert dt.redistribute(mesh, [Replicate()]).placements == (Replicate(),)
    assert dt.redistribute([Shard(1)]) is dt  # the positional form; no change, no copy


@pytest.mark.parametrize("bad", [1, -1, True, "0"])
def test_src_data_rank_is_checked(mesh, bad) -> None:
    with pytest.raises((ValueError, TypeError), match="src_data_rank"):
        distribute_tensor(_t(np.ones((2, 2))), mesh, [Replicate()], src_data_rank=bad)


def test_from_local_refuses_a_non_contiguous_stride(mesh) -> None:
    with pytest.raises(ValueError, match="is not the contiguous stride"):
        DTensor.from_local(_t(np.ones((2, 3))), mesh, [Replicate()], stride=(1, 2))
    assert DTensor.from_local(_t(np.ones((2, 3))), mesh, [Replicate()], stride=(3, 1)).shape == (2, 3)


def test_partial_avg_needs_a_float(mesh) -> None:
    with pytest.raises(ValueError, match="Partial\\('avg'\\) needs a floating-point tensor"):
        distribute_tensor(Tensor(np.ones((2, 2), np.int32)), mesh, [Partial("avg")])
