"""safetensors I/O of local MindSpore tensors for sharded checkpoints (``ShardFilePrimitives``).

The files hold the bytes a torch run writes for the same tensors, so either framework reads the
other's checkpoint.  numpy (the array type MindSpore hands out) has no bfloat16: a bfloat16 tensor
travels as its 16-bit patterns -- widening bfloat16 to float32 is exact, and the top half of each
float32 is the bfloat16 -- under the safetensors dtype ``BF16``.  Files are therefore written here
(the format is an 8-byte little-endian header length, a JSON header, then each tensor's bytes in
header order) and bfloat16 entries read here; other entries are read through safetensors' numpy
API.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor

from hp_dtensor.platform.mindspore.collectives import _plain

# safetensors' dtype codes, by the numpy dtype a tensor's bytes are held in
_CODES = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
}
BF16 = "BF16"


def _bytes_of(t: Any) -> tuple[str, np.ndarray]:
    """(safetensors dtype code, a C-contiguous array holding the tensor's bytes)."""
    plain = _plain(t)
    if plain.dtype == ms.bfloat16:
        wide = np.require(plain.astype(ms.float32).asnumpy(), np.float32, requirements="C")
        return BF16, (wide.view(np.uint32) >> 16).astype(np.uint16)
    array = np.require(plain.asnumpy(), requirements="C")
    if array.dtype not in _CODES:
        raise ValueError(f"dtype {plain.dtype} cannot be stored in a safetensors shard; supported: "
                         f"{sorted(str(d) for d in _CODES)} and bfloat16")
    return _CODES[array.dtype], array


def _from_bf16_bits(bits: np.ndarray) -> Tensor:
    wide = (bits.astype(np.uint32) << 16).view(np.float32)
    return Tensor(wide).astype(ms.bfloat16)


@dataclass
class _ShardFile:
    """An open shard file: safetensors' numpy handle, and what reading bfloat16 entries needs."""

    path: str
    handle: Any
    header: dict[str, Any]
    data_start: int


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    return header, 8 + n


def _read_bf16(file: _ShardFile, key: str, start: Sequence[int], stop: Sequence[int]) -> Tensor:
    """Rows ``start[0]:stop[0]`` of a bfloat16 entry from disk (only those bytes), then the box."""
    entry = file.header[key]
    shape = [int(s) for s in entry["shape"]]
    begin = file.data_start + int(entry["data_offsets"][0])
    if not start:
        start, stop = [0] * len(shape), shape
    lo, hi = (int(start[0]), int(stop[0])) if shape else (0, 1)
    row_bytes = 2 * int(np.prod(shape[1:], dtype=np.int64))  # (a 0-d entry: one element)
    with open(file.path, "rb") as f:
        f.seek(begin + lo * row_bytes)
        raw = f.read((hi - lo) * row_bytes)
    bits = np.frombuffer(raw, dtype="<u2").reshape((hi - lo, *shape[1:]) if shape else ())
    box = tuple(slice(int(a), int(b)) for a, b in zip(start[1:], stop[1:]))
    return _from_bf16_bits(np.ascontiguousarray(bits[(slice(None), *box)] if shape else bits))


# safetensors' own writer lays tensors out by dtype (this order, last first), then by name
_LAYOUT_ORDER = ("BOOL", "U8", "I8", "I16", "F16", BF16, "I32", "F32", "F64", "I64")


class _MsShardFiles:
    @staticmethod
    def write(tensors: Mapping[str, Any], path: str) -> None:
        """The file safetensors' torch writer makes of the same tensors, byte for byte: the same
        header (``{"format": "pt"}``, which Hugging Face loaders look for) and tensor order."""
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        encoded = {key: _bytes_of(t) for key, t in tensors.items()}
        order = sorted(encoded, key=lambda k: (-_LAYOUT_ORDER.index(encoded[k][0]), k))
        arrays = []
        offset = 0
        for key in order:
            code, array = encoded[key]
            header[key] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
            arrays.append(array)
            offset += array.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8 bytes
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for array in arrays:
                f.write(array.data)

    @staticmethod
    @contextmanager
    def open(path: str) -> Iterator[_ShardFile]:
        from safetensors import safe_open

        with safe_open(path, framework="np") as handle:  # validates the header first
            header, data_start = _read_header(path)
            yield _ShardFile(path, handle, header, data_start)

    @staticmethod
    def read(handle: Any, key: str, start: Sequence[int], stop: Sequence[int]) -> Tensor:
        """Elements ``start:stop`` of entry ``key``, reading only those bytes from disk."""
        file: _ShardFile = handle
        if file.header.get(key, {}).get("dtype") == BF16:
            return _read_bf16(file, key, start, stop)
        if not start:
            return Tensor(np.asarray(file.handle.get_tensor(key)))
        return Tensor(np.ascontiguousarray(file.handle.get_slice(key)[tuple(slice(a, b) for a, b in zip(start, stop))]))

    @staticmethod
    def crc32(t: Any) -> int:
        """crc32 of the tensor's bytes in row-major order (bfloat16: its 16-bit patterns, as torch
        holds them)."""
        return zlib.crc32(_bytes_of(t)[1].data)


SHARD_FILES = _MsShardFiles()
