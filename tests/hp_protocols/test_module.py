# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Protocol Module on one process: init_states, buffers, from_nn_module, arg-name cache,
containers, BaseModel checks, ModelSpec, the state-dict adapter, the local_map stub."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from hp_dtensor import Shard
from hp_dtensor.testing import fake_world
from hp_protocols import (
    BaseModel,
    BaseStateDictAdapter,
    LocalMapConfig,
    ModelSpec,
    Module,
    ModuleDict,
    ModuleList,
    Sequential,
    ShardingConfig,
    get_model_spec,
    register_model_spec,
)


class Toy(Module):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 4

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.empty(config.dim, config.dim))
        self.bias = nn.Parameter(torch.empty(config.dim))
        self.scale = nn.Parameter(torch.empty(config.dim))
        self.register_buffer("steps", torch.full((1,), 7.0))

    def _init_self_buffers(self, buffer_device: Any = None) -> None:
        self.steps = torch.zeros(1, device=buffer_device)

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return input @ self.weight.t() + self.bias


class ToyModel(BaseModel):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        layers: int = 2

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(10, 4)
        self.blocks = ModuleList([Toy.Config().build() for _ in range(config.layers)])


def test_init_states_and_buffers() -> None:
    torch.manual_seed(0)
    toy = Toy.Config(dim=64, init_std=0.5).build()
    toy.init_states(buffer_device="cpu")
    assert 0.4 < toy.weight.std().item() < 0.6
    assert torch.equal(toy.bias, torch.zeros(64)) and torch.equal(toy.scale, torch.ones(64))
    assert toy.steps.item() == 0.0


def test_cached_positional_arg_names() -> None:
    toy = Toy.Config().build()
    assert toy._cache_pos_arg_names() == ("input", "mask")
    assert toy._cache_pos_arg_names() is toy._cache_pos_arg_names()


def test_from_nn_module_reuses_state_and_config() -> None:
    lin = nn.Linear(4, 3)
    cfg = Module.Config()
    a, b = Module.from_nn_module(lin, cfg), Module.from_nn_module(nn.Linear(2, 2), cfg)
    assert a.config is cfg and b.config is cfg
    assert a.weight is lin.weight and set(a.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 4)
    assert torch.equal(a(x), lin(x))


def test_containers_are_protocol_modules() -> None:
    seq = Sequential(nn.Linear(2, 2), nn.ReLU())
    assert isinstance(seq, Module) and seq(torch.ones(1, 2)).shape == (1, 2)
    ml = ModuleList([nn.Linear(2, 2)])
    md = ModuleDict({"a": nn.Linear(2, 2)})
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
            self.inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            self.inner.extra = nn.Parameter(torch.ones(1))

    with pytest.raises(TypeError, match=r"\['inner'\]"):
        Bad().verify_module_protocol()


def test_model_spec_exactly_one_builder_and_registry() -> None:
    with pytest.raises(ValueError, match="exactly one .* neither"):
        ModelSpec(name="x")
    with pytest.raises(ValueError, match="both"):
        ModelSpec(name="x", build_model_fn=lambda: None, model=ToyModel.Config())
    spec = register_model_spec(ModelSpec(name="toy-test", model=ToyModel.Config(layers=1)))
    assert get_model_spec("toy-test") is spec and isinstance(spec.build(), ToyModel)
    with pytest.raises(KeyError, match="no model spec named 'nope'"):
        get_model_spec("nope")


class _Prefix(BaseStateDictAdapter):
    def to_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf.items()}


def test_state_dict_adapter_round_trip(tmp_path) -> None:
    model = ToyModel.Config().build()
    model.init_weights()
    adapter = _Prefix()
    adapter.save_hf_state_dict(model.state_dict(), str(tmp_path))
    loaded = adapter.load_hf_state_dict(str(tmp_path))
    assert set(loaded) == set(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    with pytest.raises(FileNotFoundError):
        adapter.load_hf_state_dict(str(tmp_path / "missing"))


def test_local_map_is_not_implemented_yet() -> None:
    toy = Toy.Config(sharding_config=ShardingConfig(local_map=LocalMapConfig())).build()
    with fake_world(2):
        from hp_dtensor import init_device_mesh

        with pytest.raises(NotImplementedError, match="local_map will be added in M9"):
            toy.parallelize(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))


def test_bad_state_path_names_it() -> None:
    toy = Toy.Config(sharding_config=ShardingConfig(state_shardings={"nope": {"tp": Shard(0)}})).build()
    with fake_world(2):
        from hp_dtensor import init_device_mesh

        with pytest.raises(ValueError, match="'nope'"):
            toy.parallelize(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))


def test_import_does_not_pull_tp_or_models() -> None:
    code = "import sys, hp_protocols; print([m for m in ('hp_tp', 'hp_models', 'hyper_parallel') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr

