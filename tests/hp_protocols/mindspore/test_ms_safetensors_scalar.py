# mypy: disable-error-code="no-untyped-def,import-not-found,import-untyped"
"""MindSpore's safetensors primitives keep every shape, 0-d included: an optimizer's ``step`` or a
scalar buffer saved as a 0-d tensor must load as one (numpy's ``ascontiguousarray`` turns a 0-d
array into shape (1,))."""

from __future__ import annotations

import numpy as np


def test_zero_dim_tensors_round_trip_with_their_shape(tmp_path) -> None:
    from mindspore import Tensor

    from hp_protocols.platform.mindspore.safetensors_io import load_safetensors, save_safetensors

    tensors = {
        "step": Tensor(np.float32(3.0)),
        "count": Tensor(np.int64(7)),
        "flag": Tensor(np.bool_(True)),
        "vector": Tensor(np.arange(3, dtype=np.float32)),
        "matrix_t": Tensor(np.arange(6, dtype=np.float32).reshape(2, 3).T.copy()),
    }
    save_safetensors(tensors, str(tmp_path / "s.safetensors"))
    back = load_safetensors(str(tmp_path / "s.safetensors"))
    assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in tensors.items()}
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k].asnumpy(), v.asnumpy()), k
