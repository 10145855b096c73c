"""Checkpoints' framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports what its framework supports of:
- ``SHARD_FILES`` (``safetensors_shards.ShardFilePrimitives``): safetensors files of local tensors;
- ``TRANSFER`` (``gather_to_rank.TransferPrimitives``): boxes moved between ranks for an export;
- ``DCP`` (``dcp.DCPPrimitives``): ``torch.distributed.checkpoint`` saves and loads, state dicts
  of models and optimizers, staging to CPU memory for asynchronous saves.
A feature a framework lacks raises ``NotImplementedError`` naming it when it is used.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor.platform import current as dtensor_platform
from hp_dtensor.platform import package_backend


def feature(name: str, what: str) -> Any:
    """The primitives object ``name`` of the selected framework's checkpoint code; callers type it
    with the feature's own Protocol.  ``NotImplementedError`` naming ``what`` where it is absent."""
    prims = getattr(package_backend("hp_checkpoint", what), name, None)
    if prims is None:
        raise NotImplementedError(f"{what} is not supported on the {dtensor_platform().NAME} backend yet")
    return prims
