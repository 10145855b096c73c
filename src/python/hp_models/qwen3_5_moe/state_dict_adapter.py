"""Between the MoE model's state dict and the HF ``qwen3_5_moe`` checkpoint layout.

On disk HF keeps one tensor per expert and projection
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ``(I, H)``); this model holds each
projection stacked, ``model.layers.{i}.mlp.experts.gate_proj`` ``(E, I, H)``.  Everything else is
the dense adapter's mapping.  Loading into an expert-parallel model reads only the experts (and,
under a tensor-parallel split, the rows or columns) a rank holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from hp_checkpoint.hf_export import ExportStats
from hp_dtensor import DTensor
from hp_dtensor.layout.shard_geometry import local_shape_and_offset
from hp_models.qwen3_5.state_dict_adapter import _SAFETENSORS_DTYPES, Qwen3_5StateDictAdapter, _strip
from hp_models.qwen3_5_moe.config import Qwen3_5MoeConfig

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter):
    def __init__(self, config: Qwen3_5MoeConfig) -> None:
        super().__init__(config)
        self.num_experts = config.num_experts

    def expert_keys(self, key: str) -> list[str] | None:
        """HF names of the per-expert tensors stacked in ``key``, in expert order; None for other keys."""
        m = _STACKED.match(key)
        if m is None:
            return None
        return [f"{m.group(1)}{e}.{m.group(2)}.weight" for e in range(self.num_experts)]

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        dense: dict[str, Any] = {}
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            names = self.expert_keys(key)
            if names is None:
                dense[key] = value
                continue
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if value.shape[0] != len(names):
                raise ValueError(f"{key} stacks {value.shape[0]} experts, the config has {len(names)}")
            out.update({name: value[e] for e, name in enumerate(names)})
        out.update(super().to_hf(dense))
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        experts: dict[str, dict[int, Any]] = {}
        rest: dict[str, Any] = {}
        for key, value in hf_state_dict.items():
            m = _PER_EXPERT.match(_strip(key))
            if m is None:
                rest[key] = value
            else:
                experts.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = value
        out = super().from_hf(rest)
        for key, by_expert in experts.items():
            missing = sorted(set(range(self.num_experts)) - set(by_expert))
            if missing or len(by_expert) != self.num_experts:
                raise KeyError(f"{key}: HF state dict lacks experts {missing} (config has {self.num_experts})")
            out[key] = torch.stack([by_expert[e] for e in range(self.num_experts)])
        return out

    def _plan_reads(
        self, key: str, param: Any, where: dict[str, tuple[Any, str]], path: str, allow_dtype_cast: bool
    ) -> list[Callable[[], str]]:
        names = self.expert_keys(key)
        if names is None:
            return super()._plan_reads(key, param, where, path, allow_dtype_cast)
        shape = tuple(int(n) for n in param.shape)
        if shape[0] != len(names):
            raise ValueError(f"{key} stacks {shape[0]} experts, the config has {len(names)}")
        for name in names:
            if name not in where:
                raise KeyError(f"checkpoint in {path!r} has no tensor {name!r} (for {key!r})")
            hf_slice = where[name][0].get_slice(where[name][1])
            found = tuple(int(n) for n in hf_slice.get_shape())
            if found != shape[1:]:
                raise ValueError(
                    f"checkpoint tensor {name!r} (for {key!r}) has global shape {found}, the model expects "
                    f"{shape[1:]}; the checkpoint was saved for a different config"
                )
            if _SAFETENSORS_DTYPES.get(hf_slice.get_dtype()) != param.dtype and not allow_dtype_cast:
                raise ValueError(
                    f"checkpoint tensor {name!r} (for {key!r}) has dtype {hf_slice.get_dtype()}, the model "
                    f"expects {param.dtype}; pass allow_dtype_cast=True to convert, or build the model in that dtype"
                )
        sizes, starts = [*shape], [0] * len(shape)
        if isinstance(param, DTensor):
            coord = param.device_mesh.get_coordinate()
            assert coord is not None
            sizes, starts = (list(v) for v in local_shape_and_offset(
                shape, param.device_mesh.shape, param.placements, coord))
        local = param._local_tensor if isinstance(param, DTensor) else param

        def reader(e: int) -> Callable[[], str]:
            def read() -> str:
                handle, name = where[names[starts[0] + e]]
                index = tuple(slice(st, st + n) for st, n in zip(starts[1:], sizes[1:]))
                local[e].copy_(handle.get_slice(name)[index].to(local.dtype))
                return names[starts[0] + e]
            return read

        return [reader(e) for e in range(sizes[0])]

    def hf_groups(self, keys: list[str]) -> dict[str, list[str]]:
        if any(self.expert_keys(k) is not None for k in keys):
            raise NotImplementedError(
                "sharded HF export of stacked experts is not supported yet; gather with to_hf(model.state_dict()) "
                "and write it with safetensors"
            )
        return super().hf_groups(keys)

    def save(self, model: Any, path: str, *, max_shard_bytes: int | None = None) -> ExportStats:
        self.hf_groups(list(model.state_dict()))
        return super().save(model, path, max_shard_bytes=max_shard_bytes)
