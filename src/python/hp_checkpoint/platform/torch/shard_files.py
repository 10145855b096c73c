"""safetensors I/O of local torch tensors for sharded checkpoints (``ShardFilePrimitives``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch


class _TorchShardFiles:
    @staticmethod
    def write(tensors: Mapping[str, torch.Tensor], path: str) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})

    @staticmethod
    def open(path: str) -> AbstractContextManager[Any]:
        from safetensors import safe_open

        return safe_open(path, framework="pt")  # type: ignore[no-any-return]

    @staticmethod
    def read(handle: Any, key: str, start: Sequence[int], stop: Sequence[int]) -> torch.Tensor:
        """Elements ``start:stop`` of entry ``key``, reading only those bytes from disk."""
        if not start:
            return handle.get_tensor(key)  # type: ignore[no-any-return]
        return handle.get_slice(key)[tuple(slice(a, b) for a, b in zip(start, stop))]  # type: ignore[no-any-return]

    @staticmethod
    def crc32(t: torch.Tensor) -> int:
        """crc32 of the tensor's bytes in row-major order (any dtype, any strides)."""
        import zlib

        flat = t.detach().contiguous().reshape(-1)
        return zlib.crc32(flat.view(torch.uint8).numpy().data) if flat.numel() else 0  # no copy


SHARD_FILES = _TorchShardFiles()
