# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-arg,call-overload"
"""hp_protocols on MindSpore Cells in one process (the twin of ``tests/hp_protocols/test_module.py``):
init_states and buffers, the call's argument names (``construct``), from_nn_module, the
containers, BaseModel's checks, ModelSpec, the state-dict adapter (files torch reads too), and
that importing hp_protocols pulls in neither torch nor hp_tp."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from hp_dtensor.platform import current
from hp_protocols import (
    BaseModel,
    BaseStateDictAdapter,
    ModelSpec,
    Module,
    ModuleDict,
    ModuleList,
    Sequential,
    get_model_spec,
    register_model_spec,
)


class Toy(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 4

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        d = config.dim
        self.weight = Parameter(Tensor(np.full((d, d), 5.0, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.full((d,), 5.0, np.float32)), name="bias")
        self.scale = Parameter(Tensor(np.full((d,), 5.0, np.float32)), name="scale")
        self.register_buffer("steps", Tensor(np.full((1,), 7.0, np.float32)))

    def _init_self_buffers(self, buffer_device: Any = None) -> None:
        self.register_buffer("steps", Tensor(np.zeros((1,), np.float32)))  # MindSpore refuses setattr on a buffer

    def construct(self, input: Any, mask: Any = None) -> Any:
        return ops.dense(input, self.weight, self.bias)


class ToyModel(BaseModel):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        layers: int = 2

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(10, 4)
        self.blocks = ModuleList([Toy.Config().build() for _ in range(config.layers)])


def test_init_states_and_buffers() -> None:
    ms.set_seed(0)
    toy = Toy.Config(dim=64, init_std=0.5).build()
    toy.init_states(buffer_device="cpu")
    assert 0.45 < toy.weight.asnumpy().std() < 0.55
    assert (toy.bias.asnumpy() == 0).all() and (toy.scale.asnumpy() == 1).all()
    assert toy.steps.asnumpy().item() == 0.0


def test_cached_positional_arg_names_read_construct() -> None:
    toy = Toy.Config().build()
    assert toy._cache_pos_arg_names() == ("input", "mask")
    assert toy._cache_pos_arg_names() is toy._cache_pos_arg_names()


def test_from_nn_module_reuses_state_and_config() -> None:
    dense = nn.Dense(4, 3)
    cfg = Module.Config()
    a, b = Module.from_nn_module(dense, cfg), Module.from_nn_module(nn.Dense(2, 2), cfg)
    assert a.config is cfg and b.config is cfg
    assert a.weight is dense.weight and set(current().state_dict(a)) == {"weight", "bias"}
    x = Tensor(np.random.RandomState(0).randn(2, 4).astype(np.float32))
    np.testing.assert_array_equal(a(x).asnumpy(), dense(x).asnumpy())
    with pytest.raises(TypeError, match="expects a framework module, got int"):
        Module.from_nn_module(3)


def test_containers_are_protocol_modules() -> None:
    seq = Sequential(nn.Dense(2, 2), nn.ReLU())
    assert isinstance(seq, Module) and seq(Tensor(np.ones((1, 2), np.float32))).shape == (1, 2)
    ml = ModuleList([nn.Dense(2, 2)])
    md = ModuleDict({"a": nn.Dense(2, 2)})
    assert isinstance(ml, Module) and len(ml) == 1 and isinstance(md, Module) and "a" in md


def test_base_model_verify_flops_and_init() -> None:
    model = ToyModel.Config().build()
    model.verify_module_protocol()
    model.init_weights()
    nparams, flops = model.get_nparams_and_flops(seq_len=8)
    assert nparams == 40 + 2 * (16 + 4 + 4)
    assert flops == 6 * (nparams - 40)

    class Bad(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.SequentialCell([nn.Dense(2, 2), nn.Dense(2, 2)])
            self.inner.extra = Parameter(Tensor(np.ones((1,), np.float32)), name="extra")

    with pytest.raises(TypeError, match=r"\['inner'\]"):
        Bad().verify_module_protocol()


def test_model_spec_exactly_one_builder_and_registry() -> None:
    with pytest.raises(ValueError, match="exactly one .* neither"):
        ModelSpec(name="x")
    spec = register_model_spec(ModelSpec(name="toy-ms", model=ToyModel.Config(layers=1)))
    assert get_model_spec("toy-ms") is spec and isinstance(spec.build(), ToyModel)


class _Prefix(BaseStateDictAdapter):
    def to_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf.items()}


def test_state_dict_adapter_round_trip(tmp_path) -> None:
    from safetensors.numpy import load_file

    model = ToyModel.Config().build()
    model.init_weights()
    state = current().state_dict(model)
    adapter = _Prefix()
    adapter.save_hf_state_dict(state, str(tmp_path))
    loaded = adapter.load_hf_state_dict(str(tmp_path))
    assert set(loaded) == set(state) and all(isinstance(v, Tensor) for v in loaded.values())
    for k, v in state.items():
        np.testing.assert_array_equal(loaded[k].asnumpy(), v.asnumpy(), err_msg=k)
    # Plain safetensors, HF names: what a torch run (or HF) reads.
    raw = load_file(os.path.join(tmp_path, "model.safetensors"))
    np.testing.assert_array_equal(raw["model.embed.embedding_table"], state["embed.embedding_table"].asnumpy())
    with pytest.raises(FileNotFoundError):
        adapter.load_hf_state_dict(str(tmp_path / "missing"))


def test_import_pulls_neither_torch_nor_tp() -> None:
    code = ("import sys, hp_protocols, hp_protocols.module; print(hp_protocols.module.FORWARD, "
            "[m for m in ('torch', 'hp_tp', 'hp_models', 'hyper_parallel') if m in sys.modules])")
    env = dict(os.environ, HYPER_PARALLEL_PLATFORM="mindspore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "construct []", out.stdout + out.stderr
