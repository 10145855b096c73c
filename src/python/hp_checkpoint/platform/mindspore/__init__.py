"""Checkpoints' MindSpore primitives: safetensors shard files and box transfer (no DCP)."""

from hp_checkpoint.platform.mindspore.shard_files import SHARD_FILES
from hp_checkpoint.platform.mindspore.transfer import TRANSFER

__all__ = ["SHARD_FILES", "TRANSFER"]
