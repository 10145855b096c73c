"""TensorBoard event files for scalars, written without TensorBoard: what a ``tfevents`` file
holds is a sequence of TFRecords, each an ``Event`` protobuf, which this module encodes by hand.

A record is ``length`` (uint64, little endian), the masked CRC-32C of those 8 bytes (uint32), the
data, and the masked CRC-32C of the data; masking is ``((crc >> 15) | (crc << 17)) + 0xa282ead8``
modulo 2^32.  The data are an ``Event``: ``wall_time`` (field 1, double), ``step`` (field 2,
int64 varint), ``file_version`` (field 3, string: ``brain.Event:2`` in the first record) or
``summary`` (field 5): a ``Summary`` of ``value`` entries (field 1), each a ``tag`` (field 1,
string) and a ``simple_value`` (field 2, float32).  ``tensorboard --logdir <out-dir>`` reads the
files (any name containing ``tfevents``).  Pure Python, no framework.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from typing import BinaryIO

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _CRC32C_POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 as protobuf writes it: two's complement, ten bytes
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2) + _varint(len(data)) + data


_FLOAT32_MAX = 3.4028234663852886e38


def _float32(value: float) -> bytes:
    """``value`` as float32 (beyond its range: inf of the same sign, as a float32 cast gives)."""
    if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
        value = math.copysign(math.inf, value)
    return struct.pack("<f", value)


def _scalar_value(tag: str, value: float) -> bytes:
    return _bytes_field(1, tag.encode()) + _field(2, 5) + _float32(value)


def event(wall_time: float, step: int, *, scalars: dict[str, float] | None = None,
          file_version: str | None = None) -> bytes:
    """One ``Event`` message: a summary of ``scalars`` or the ``file_version`` header."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        summary = b"".join(_bytes_field(1, _scalar_value(tag, float(v))) for tag, v in scalars.items())
        out += _bytes_field(5, summary)
    return out


class EventWriter:
    """Scalars of each step appended to a new ``events.out.tfevents.*`` file in ``logdir``
    (flushed after every step, so a killed run keeps what it wrote)."""

    def __init__(self, logdir: str) -> None:
        os.makedirs(logdir, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = os.path.join(logdir, name)
        self._file: BinaryIO = open(self.path, "wb")
        self._file.write(record(event(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        self._file.write(record(event(time.time() if wall_time is None else wall_time, step, scalars=scalars)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
