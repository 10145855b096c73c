# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""A checkpoint saved for another config is refused, naming the tensor with the expected and the
found global shape (or dtype), before anything is copied -- also under tensor parallelism, where
each rank's slice of a larger tensor would otherwise fit and load a corner of it silently."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)


def _small(**overrides: Any) -> Any:
    from hp_models.qwen3_5 import tiny_config

    base: dict[str, Any] = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 512, "chunk_size": 8}
    return tiny_config(**{**base, **overrides})


def _save(cfg: Any, folder: str, dtype: Any = None) -> None:
    import torch

    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter

    torch.manual_seed(0)
    model = cfg.build()
    if dtype is not None:
        model = model.to(dtype)
    Qwen3_5StateDictAdapter(cfg).save(model, folder)


@pytest.mark.parametrize(
    "saved,tensor,expected,found",
    [
        ({"intermediate_size": 768}, "model.layers.0.mlp.gate_proj.weight", "(512, 64)", "(768, 64)"),
        ({"linear_num_value_heads": 4}, "model.layers.0.linear_attn.conv1d.weight", "(512, 1, 4)", "(384, 1, 4)"),
        ({"vocab_size": 256}, "model.embed_tokens.weight", "(128, 64)", "(256, 64)"),
    ],
    ids=["intermediate_768_vs_512", "value_heads", "vocab"],
)
def test_other_config_is_refused_naming_tensor(tmp_path, saved: dict[str, Any], tensor: str, expected: str,
                                                 found: str) -> None:
    import torch

    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter

    _save(_small(**saved), str(tmp_path))
    cfg = _small()
    model = cfg.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        Qwen3_5StateDictAdapter(cfg).load_into(model, str(tmp_path))
    msg = str(info.value)
    assert repr(tensor) in msg and f"global shape {found}" in msg and f"expects {expected}" in msg, msg
    # refused before anything was copied
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_other_dtype_is_refused_unless_cast_is_asked(tmp_path) -> None:
    import torch

    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter

    cfg = _small()
    _save(cfg, str(tmp_path), dtype=torch.bfloat16)
    adapter = Qwen3_5StateDictAdapter(cfg)
    model = cfg.build()
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight'.*dtype BF16, the model expects torch.float32"):
        adapter.load_into(model, str(tmp_path))
    read = adapter.load_into(model, str(tmp_path), allow_dtype_cast=True)
    assert len(read) == len(model.state_dict())
    assert model.model.embed_tokens.weight.dtype == torch.float32


def _tp_load_bigger(rank: int, world: int, folder: str) -> str:
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, parallelize_qwen3_5_tp

    _save(_small(intermediate_size=768), folder)  # collective: every rank holds the whole (plain) model
    cfg = _small()
    model = parallelize_qwen3_5_tp(cfg.build(), init_device_mesh("cpu", (world,)))
    try:
        Qwen3_5StateDictAdapter(cfg).load_into(model, folder)
    except ValueError as e:
        return str(e)
    return "no error"


def test_tp_rank_slices_of_a_bigger_checkpoint_are_refused_on_every_rank(pool2: RankPool) -> None:
    folder = tempfile.mkdtemp()
    try:
        for msg in pool2.run(_tp_load_bigger, os.path.join(folder, "ckpt")):
            assert "'model.layers.0.mlp.gate_proj.weight'" in msg and "global shape (768, 64)" in msg, msg
    finally:
        shutil.rmtree(folder, ignore_errors=True)
