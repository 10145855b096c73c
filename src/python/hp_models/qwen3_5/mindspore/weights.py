"""A HF ``qwen3_5`` safetensors checkpoint into and out of the MindSpore model through the torch
model's ``Qwen3_5StateDictAdapter`` (the key layout is the same, so one HF file serves both): a
whole-file load on one process, and the sharded export every rank of a parallel model joins."""

from __future__ import annotations

import os
from typing import Any

from mindspore import mint

from hp_checkpoint.hf_export import ExportStats
from hp_dtensor.platform import current
from hp_models.qwen3_5.config import Qwen3_5Config
from hp_models.qwen3_5.mindspore.model import Qwen3_5ForCausalLM
from hp_models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter


def load_hf_weights(model: Qwen3_5ForCausalLM, path: str) -> list[str]:
    """Copy every tensor of the HF checkpoint folder ``path`` into ``model`` (full tensors, one
    process); returns this model's keys that were set (with tied embeddings ``lm_head.weight``
    is the embedding and is not listed).

    Fails closed before anything is copied: ``FileNotFoundError`` for a missing folder or one
    without safetensors, ``KeyError`` naming the model keys the checkpoint lacks (or the
    checkpoint keys the model lacks), ``ValueError`` naming a tensor whose shape or dtype differs
    from the model's (a checkpoint saved for another config or dtype)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    config: Qwen3_5Config = model.config  # type: ignore[assignment]
    loaded: dict[str, Any] = Qwen3_5StateDictAdapter(config).load_hf_state_dict(path)
    state = current().state_dict(model)
    if config.tie_word_embeddings:
        # The head is the embedding: read once, as model.embed_tokens.weight (a HF file of a tied
        # model may still hold lm_head.weight; HF ignores it too).
        state.pop("lm_head.weight", None)
        loaded.pop("lm_head.weight", None)
    missing, extra = sorted(set(state) - set(loaded)), sorted(set(loaded) - set(state))
    if missing or extra:
        raise KeyError(
            f"checkpoint in {path!r} does not match the model: missing {missing}, unexpected {extra}; "
            f"was it saved for another config (tie_word_embeddings, layer_types)?"
        )
    for key, param in state.items():
        value = loaded[key]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensor for {key!r} has shape {tuple(value.shape)}, the model expects "
                f"{tuple(param.shape)}; the checkpoint was saved for a different config"
            )
        if value.dtype != param.dtype:
            raise ValueError(
                f"checkpoint tensor for {key!r} has dtype {value.dtype}, the model expects {param.dtype}; "
                f"build the model in that dtype or convert the checkpoint"
            )
    for key, param in state.items():
        param.set_data(loaded[key])
    return list(state)


class Qwen3_5MsStateDictAdapter(Qwen3_5StateDictAdapter):
    """The torch model's adapter (names, fusions, groups) joining MindSpore tensors."""

    @staticmethod
    def _concat_rows(parts: list[Any]) -> Any:
        return mint.cat(parts, 0)


def save_hf_weights(model: Qwen3_5ForCausalLM, path: str, *, max_shard_bytes: int | None = None) -> ExportStats:
    """Write the model as HF ``model-0000k-of-0000n.safetensors`` shards with
    ``model.safetensors.index.json`` and ``config.json`` into ``path``: the files the torch model's
    ``Qwen3_5StateDictAdapter.save`` writes for the same weights.  Collective: every rank of a
    tensor-parallel or ``fully_shard``-ed model calls it (a one-process model alone).  Each HF
    tensor is built whole on its writer rank only, from the shards moved to it; a rank failing a
    conversion or a write raises ``RuntimeError`` on every rank and no index is written."""
    config: Qwen3_5Config = model.config  # type: ignore[assignment]
    return Qwen3_5MsStateDictAdapter(config).export(current().state_dict(model), path,
                                                    max_shard_bytes=max_shard_bytes)
