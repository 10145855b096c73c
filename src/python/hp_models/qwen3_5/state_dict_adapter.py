"""Between this model's state dict and the HF ``qwen3_5`` checkpoint layout.

Names match HF except in linear-attention layers, where HF fuses q/k/v into ``in_proj_qkv`` and
one depthwise ``conv1d`` over the fused channels; here they are split (so each can be sharded by
head).  Loading into a tensor-parallel model reads only the rows or columns each rank holds.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from hp_dtensor import DTensor, Shard
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_protocols import BaseStateDictAdapter

_PREFIXES = ("model.language_model.", "model.")
_QKV = ("q", "k", "v")


class Qwen3_5StateDictAdapter(BaseStateDictAdapter):
    def __init__(self, config: Qwen3_5Config) -> None:
        self.config = config
        kd = config.linear_num_key_heads * config.linear_key_head_dim
        vd = config.linear_num_value_heads * config.linear_value_head_dim
        self._split = {"q": (0, kd), "k": (kd, kd), "v": (2 * kd, vd)}  # (row offset, rows) in the fused tensor

    # ----- names -----
    def hf_source(self, key: str) -> tuple[str, int]:
        """(HF tensor name, row offset) that this model's ``key`` is read from."""
        m = re.match(r"^(model\.layers\.\d+\.linear_attn\.)(in_proj_|conv_)([qkv])(\.weight)?$", key)
        if m:
            base, kind, part = m.group(1), m.group(2), m.group(3)
            hf = base + ("in_proj_qkv.weight" if kind == "in_proj_" else "conv1d.weight")
            return hf, self._split[part][0]
        return key, 0

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        fused: dict[str, dict[str, Any]] = {}
        for key, value in state_dict.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            hf, _ = self.hf_source(key)
            if hf != key:
                part = re.search(r"(?:in_proj_|conv_)([qkv])", key)
                assert part is not None
                fused.setdefault(hf, {})[part.group(1)] = value
            else:
                out[key] = value
        for hf, parts in fused.items():
            cat = torch.cat([parts[p] for p in _QKV], dim=0)
            out[hf] = cat.unsqueeze(1) if hf.endswith("conv1d.weight") else cat
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        hf = {_strip(k): v for k, v in hf_state_dict.items() if not k.startswith(("mtp.", "model.visual."))}
        out: dict[str, Any] = {}
        for key, value in hf.items():
            m = re.match(r"^(model\.layers\.\d+\.linear_attn\.)(in_proj_qkv\.weight|conv1d\.weight)$", key)
            if m:
                for part in _QKV:
                    start, rows = self._split[part]
                    piece = value[start : start + rows]
                    if m.group(2).startswith("conv1d"):
                        out[f"{m.group(1)}conv_{part}"] = piece.squeeze(1)
                    else:
                        out[f"{m.group(1)}in_proj_{part}.weight"] = piece
            else:
                out[key] = value
        if self.config.tie_word_embeddings and "lm_head.weight" not in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    # ----- sharded loading -----
    def load_into(self, model: Any, path: str) -> list[str]:
        """Copy the checkpoint in ``path`` into ``model`` in place, reading from disk only the slice
        of each tensor this rank holds.  Returns the HF names read (for checks)."""
        from contextlib import ExitStack

        from safetensors import safe_open

        read: list[str] = []
        with ExitStack() as stack, torch.no_grad():
            # Each file is opened once; tensors are found by their prefix-free HF name.
            where: dict[str, tuple[Any, str]] = {}
            for f in _checkpoint_files(path):
                handle = stack.enter_context(safe_open(f, framework="pt"))
                for name in handle.keys():  # noqa: SIM118  (safe_open handles are not mappings)
                    where[_strip(name)] = (handle, name)
            for key, param in model.state_dict(keep_vars=True).items():
                hf_key, offset = self.hf_source(key)
                if hf_key not in where and key == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                if hf_key not in where:
                    raise KeyError(f"checkpoint in {path!r} has no tensor {hf_key!r} (for {key!r})")
                local = param._local_tensor if isinstance(param, DTensor) else param
                handle, name = where[hf_key]
                piece = handle.get_slice(name)[_local_index(param, offset)]
                if hf_key.endswith("conv1d.weight"):
                    piece = piece.squeeze(1)
                if tuple(piece.shape) != tuple(local.shape):
                    raise ValueError(
                        f"{key}: checkpoint slice has shape {tuple(piece.shape)}, the model holds {tuple(local.shape)}"
                    )
                local.copy_(piece.to(local.dtype))
                read.append(hf_key)
        return read

    def save(self, model: Any, path: str) -> None:
        """Write ``model.safetensors`` and ``config.json`` (full tensors; call on every rank, rank 0 writes)."""
        sd = self.to_hf(model.state_dict())
        if _rank() == 0:
            os.makedirs(path, exist_ok=True)
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(self.config.to_hf_dict(), f, indent=2)


def _strip(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return "model." + key[len(p):]
    return key


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _checkpoint_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path!r}")
    return files


def _local_index(param: Any, row_offset: int) -> tuple[slice, ...]:
    """Slices of the (HF) tensor holding this rank's shard of ``param``."""
    shape = tuple(param.shape)
    index = [slice(0, n) for n in shape]
    if isinstance(param, DTensor):
        coord = param.device_mesh.get_coordinate()
        assert coord is not None
        for k, p in enumerate(param.placements):
            if isinstance(p, Shard):
                size = param._local_tensor.shape[p.dim]
                index[p.dim] = slice(coord[k] * size, (coord[k] + 1) * size)
    index[0] = slice(index[0].start + row_offset, index[0].stop + row_offset)
    return tuple(index)
