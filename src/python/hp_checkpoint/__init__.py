"""hp_checkpoint: sharded, atomic, verified and reshardable checkpoints for hyper-parallel.

Every rank writes only its own shards (replicas once) into a staging directory; a manifest with
each file's size and sha256 and each tensor's global shape and dtype is written last, then the
directory is renamed into place, so a kill at any moment leaves the previous checkpoint intact.
A load verifies before it reads and reshards to whatever layout the state dict now has.  Two
formats: ``torch.distributed.checkpoint`` (``save_checkpoint`` / ``load_checkpoint``, torch) and
framework-neutral safetensors shards (``save_shards`` / ``load_shards``, torch and MindSpore).
HF exports (``export_hf_safetensors``) build each tensor on one writer rank only.
"""

from __future__ import annotations

from hp_checkpoint.async_save import AsyncCheckpointer
from hp_checkpoint.atomic import latest_checkpoint, load_checkpoint, save_checkpoint
from hp_checkpoint.dcp import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from hp_checkpoint.hf_export import ExportStats, export_hf_safetensors
from hp_checkpoint.manifest import (
    CheckpointKind,
    Framework,
    Manifest,
    complete_checkpoints,
    newest_complete,
    prune,
    verify_checkpoint,
)
from hp_checkpoint.safetensors_shards import load_shards, save_shards
from hp_dtensor.layout.shard_boxes import CheckpointError

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointer", "CheckpointError", "CheckpointKind", "ExportStats", "Framework", "Manifest",
    "complete_checkpoints", "export_hf_safetensors", "get_model_state_dict", "get_optimizer_state_dict",
    "latest_checkpoint", "load_checkpoint", "load_shards", "newest_complete", "prune", "save_checkpoint",
    "save_shards", "set_model_state_dict", "set_optimizer_state_dict", "verify_checkpoint",
]
