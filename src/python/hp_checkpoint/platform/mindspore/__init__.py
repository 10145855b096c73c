"""Checkpoints' MindSpore primitives: safetensors shard files and box transfer (no DCP)."""

from hp_checkpoint.platform.mindspore.transfer import SHARD_FILES, TRANSFER

__all__ = ["SHARD_FILES", "TRANSFER"]
