"""Between this model's state dict and the HF ``qwen3_5`` checkpoint layout.

Names match HF except in linear-attention layers, where HF fuses q/k/v into ``in_proj_qkv`` and
one depthwise ``conv1d`` over the fused channels; here they are split (so each can be sharded by
head).  Loading into a tensor-parallel model reads only the rows or columns each rank holds.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from hp_checkpoint.hf_export import INDEX_NAME, ExportStats, export_hf_safetensors
from hp_dtensor import DTensor
from hp_dtensor.layout.shard_geometry import local_shape_and_offset
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_protocols import BaseStateDictAdapter

_PREFIXES = ("model.language_model.", "model.")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
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
            cat = self._concat_rows([parts[p] for p in _QKV])
            out[hf] = cat.unsqueeze(1) if hf.endswith("conv1d.weight") else cat
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    @staticmethod
    def _concat_rows(parts: list[Any]) -> Any:
        """``parts`` joined along dim 0 (torch tensors; the MindSpore model's adapter joins its own)."""
        return torch.cat(parts, dim=0)

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
    def load_into(self, model: Any, path: str, *, allow_dtype_cast: bool = False) -> list[str]:
        """Copy the checkpoint in ``path`` into ``model`` in place, reading from disk only the slice
        of each tensor this rank holds.  Returns the HF names read (for checks).

        Every checkpoint tensor's *global* shape and dtype are checked against the model before
        anything is read, so a checkpoint of another size (say intermediate 768 into a model of
        512) is refused naming the tensor instead of loading a corner of it.  A dtype other than
        the model's is refused too unless ``allow_dtype_cast=True`` (e.g. a bf16 checkpoint into
        an fp32 model).  With tied embeddings ``lm_head.weight`` is the embedding parameter and is
        read once, as ``model.embed_tokens.weight``."""
        from contextlib import ExitStack

        from safetensors import safe_open

        read: list[str] = []
        with ExitStack() as stack, torch.no_grad():
            # Each file is opened once; tensors are found by their prefix-free HF name.
            where: dict[str, tuple[Any, str]] = {}
            for f in _checkpoint_files(path):
                handle = stack.enter_context(safe_open(f, framework="pt"))
                for name in handle.keys():  # noqa: SIM118  (safe_open handles are not mappings)
                    if _strip(name) in where:
                        raise ValueError(
                            f"checkpoint in {path!r} holds tensor {_strip(name)!r} twice (in {f!r} and another "
                            f"file); remove the stale file"
                        )
                    where[_strip(name)] = (handle, name)
            params = model.state_dict(keep_vars=True)
            if self.config.tie_word_embeddings:
                if params.get("lm_head.weight") is not params.get("model.embed_tokens.weight"):
                    raise ValueError(
                        "tie_word_embeddings=True but the model's lm_head.weight is not its "
                        "model.embed_tokens.weight (the tie was broken); re-tie them before loading"
                    )
                params.pop("lm_head.weight", None)
            reads: list[Callable[[], str]] = []
            for key, param in params.items():
                reads.extend(self._plan_reads(key, param, where, path, allow_dtype_cast))
            read.extend(r() for r in reads)  # every global shape and dtype is checked before any read
        return read

    def _plan_reads(
        self, key: str, param: Any, where: dict[str, tuple[Any, str]], path: str, allow_dtype_cast: bool
    ) -> list[Callable[[], str]]:
        """Check ``param``'s HF source(s) and return the reads that fill this rank's shard of it,
        each a zero-argument callable returning the HF name it read."""
        hf_key, offset = self.hf_source(key)
        if hf_key not in where:
            raise KeyError(f"checkpoint in {path!r} has no tensor {hf_key!r} (for {key!r})")
        handle, name = where[hf_key]
        self._check_global(key, hf_key, param, handle.get_slice(name), allow_dtype_cast)

        def read() -> str:
            local = param._local_tensor if isinstance(param, DTensor) else param
            piece = handle.get_slice(name)[_local_index(param, offset)]
            if hf_key.endswith("conv1d.weight"):
                piece = piece.squeeze(1)
            if tuple(piece.shape) != tuple(local.shape):
                raise ValueError(
                    f"{key}: checkpoint slice has shape {tuple(piece.shape)}, the model holds {tuple(local.shape)}"
                )
            local.copy_(piece.to(local.dtype))
            return hf_key

        return [read]

    def _expected_hf_shape(self, key: str, hf_key: str, param: Any) -> tuple[int, ...]:
        """Global shape the HF tensor ``hf_key`` must have for this model's ``key``."""
        shape = tuple(int(n) for n in param.shape)
        if hf_key == key:
            return shape
        fused_rows = sum(rows for _, rows in self._split.values())
        if hf_key.endswith("conv1d.weight"):
            return (fused_rows, 1, *shape[1:])
        return (fused_rows, *shape[1:])

    def _check_global(self, key: str, hf_key: str, param: Any, hf_slice: Any, allow_dtype_cast: bool) -> None:
        found = tuple(int(n) for n in hf_slice.get_shape())
        expected = self._expected_hf_shape(key, hf_key, param)
        if found != expected:
            raise ValueError(
                f"checkpoint tensor {hf_key!r} (for {key!r}) has global shape {found}, the model expects "
                f"{expected}; the checkpoint was saved for a different config"
            )
        found_dtype = _SAFETENSORS_DTYPES.get(hf_slice.get_dtype())
        if found_dtype != param.dtype and not allow_dtype_cast:
            raise ValueError(
                f"checkpoint tensor {hf_key!r} (for {key!r}) has dtype {hf_slice.get_dtype()}, the model expects "
                f"{param.dtype}; pass allow_dtype_cast=True to convert, or build the model in that dtype"
            )

    def hf_groups(self, keys: list[str]) -> dict[str, list[str]]:
        """Each HF tensor name -> this model's keys it is built from (q, k, v for a fused one), in
        the order of ``keys``; with tied embeddings ``lm_head.weight`` is not exported (HF re-ties)."""
        groups: dict[str, list[str]] = {}
        for key in keys:
            if key == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            groups.setdefault(self.hf_source(key)[0], []).append(key)
        return groups

    def save(self, model: Any, path: str, *, max_shard_bytes: int | None = None) -> ExportStats:
        """Write HF ``model-0000k-of-0000n.safetensors`` shards, ``model.safetensors.index.json``
        and ``config.json`` into ``path``.  Collective: call on every rank.  No rank holds the
        model: each HF tensor is assembled on one writer rank only (writers balanced by bytes),
        which writes its file(s); rank 0 writes the index and config."""
        return self.export(model.state_dict(), path, max_shard_bytes=max_shard_bytes)

    def export(self, state_dict: dict[str, Any], path: str, *, max_shard_bytes: int | None = None) -> ExportStats:
        """``save`` of a state dict (this model's names; DTensors or whole tensors of either
        framework): what ``save`` runs on a torch model's ``state_dict()`` and the MindSpore
        model's export on its parameters."""
        return export_hf_safetensors(
            state_dict, path, groups=self.hf_groups(list(state_dict)), convert=self.to_hf,
            max_shard_bytes=max_shard_bytes, extra_json={"config.json": self.config.to_hf_dict()},
        )


def _strip(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return "model." + key[len(p):]
    return key


def _checkpoint_files(path: str) -> list[str]:
    """The weight files of the checkpoint in ``path``: those its index names when it has one
    (each must exist), else every ``*.safetensors`` file."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"checkpoint index {index!r} is not a valid index (needs a weight_map): {e}") from e
        absent = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if absent:
            raise FileNotFoundError(f"checkpoint index {index!r} names files that are missing: {absent}")
        return [os.path.join(path, n) for n in names]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path!r}")
    return files

def _local_index(param: Any, row_offset: int) -> tuple[slice, ...]:
    """Slices of the (HF) tensor holding this rank's shard of ``param``.  Several mesh dims may
    shard one tensor dim (FSDP's ``Shard(0)`` on top of a TP ``Shard(0)``): each splits what the
    earlier ones left, as ``torch.chunk`` would."""
    shape = tuple(int(n) for n in param.shape)
    index = [slice(0, n) for n in shape]
    if isinstance(param, DTensor):
        coord = param.device_mesh.get_coordinate()
        assert coord is not None
        sizes, starts = local_shape_and_offset(shape, param.device_mesh.shape, param.placements, coord)
        index = [slice(start, start + size) for start, size in zip(starts, sizes)]
    index[0] = slice(index[0].start + row_offset, index[0].stop + row_offset)
    return tuple(index)
