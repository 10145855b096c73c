# mypy: disable-error-code="no-untyped-def"
"""The trainer's metrics: a tp=2 run on 2 gloo ranks writes TensorBoard event files beside
log.json whose records (read back here by a reader of their own: the TFRecord framing with its
masked CRC-32C checked bit by bit, the Event and Summary protobufs decoded field by field) hold
each step's loss, learning rate and gradient norm as log.json has them, tokens/s and the peak
memory of both ranks; a resumed run adds a file whose steps continue."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

from hp_models import train
from hp_models.trainer.tensorboard import EventWriter

SHORT = ["--tp", "2", "--seq-len", "16", "--batch-size", "4", "--lr", "1e-2", "--checkpoint-every", "3",
         "--max-grad-norm", "1.0", "--lr-warmup-steps", "1"]


# ---------------------------------------------------------------- an independent reader
def _crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = _crc32c_bitwise(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path: str) -> list[bytes]:
    raw = open(path, "rb").read()
    out, at = [], 0
    while at < len(raw):
        head = raw[at:at + 8]
        (n,) = struct.unpack("<Q", head)
        assert struct.unpack("<I", raw[at + 8:at + 12])[0] == _masked(head), f"length CRC at {at}"
        data = raw[at + 12:at + 12 + n]
        assert struct.unpack("<I", raw[at + 12 + n:at + 16 + n])[0] == _masked(data), f"data CRC at {at}"
        out.append(data)
        at += 16 + n
    assert at == len(raw)
    return out


def _fields(msg: bytes) -> list[tuple[int, Any]]:
    """(field number, value) of a protobuf message: varints as ints, fixed64 as doubles, fixed32
    as floats, length-delimited as bytes."""
    out: list[tuple[int, Any]] = []
    at = 0

    def varint() -> int:
        nonlocal at
        shift = value = 0
        while True:
            b = msg[at]
            at += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while at < len(msg):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 1:
            out.append((number, struct.unpack("<d", msg[at:at + 8])[0]))
            at += 8
        elif wire == 5:
            out.append((number, struct.unpack("<f", msg[at:at + 4])[0]))
            at += 4
        else:
            assert wire == 2, wire
            n = varint()
            out.append((number, msg[at:at + n]))
            at += n
    return out


def read_events(path: str) -> tuple[str, dict[int, dict[str, float]]]:
    """The file version and the scalars by step of one event file."""
    records = [dict(_fields(r)) for r in _records(path)]
    version = records[0][3].decode()
    steps: dict[int, dict[str, float]] = {}
    for ev in records[1:]:
        assert isinstance(ev[1], float) and ev[1] > 1.6e9  # wall time
        for number, value in _fields(ev[5]):
            assert number == 1
            v = dict(_fields(value))
            steps.setdefault(ev[2], {})[v[1].decode()] = v[2]
    return version, steps


def _f32(x: float) -> float:
    import numpy as np

    with np.errstate(over="ignore"):
        return float(np.float32(x))


# ---------------------------------------------------------------- the writer alone
def test_writer_round_trip(tmp_path) -> None:
    w = EventWriter(str(tmp_path))
    values = {"loss": 7.25, "lr": 3e-3, "a/b": -1.5e-7, "big": 1e30}
    for step in (1, 2, 2**40):
        w.add_scalars(step, {k: v * step for k, v in values.items()}, wall_time=1.7e9 + step)
    w.close()
    assert os.path.basename(w.path).startswith("events.out.tfevents.")
    version, steps = read_events(w.path)
    assert version == "brain.Event:2" and sorted(steps) == [1, 2, 2**40]
    for step, got in steps.items():
        assert got == {k: _f32(v * step) for k, v in values.items()}
    assert steps[2**40]["big"] == math.inf  # beyond float32: inf, as a cast gives


# ---------------------------------------------------------------- a run on 2 ranks
def test_run_writes_event_files_beside_log_json(tmp_path) -> None:
    out = tmp_path / "run"
    assert train.main([*SHORT, "--steps", "3", "--out-dir", str(out)]) == 0
    log = json.loads((out / "log.json").read_text())
    tb = out / "tensorboard"
    assert log["tensorboard_dir"] == str(tb)
    (first,) = os.listdir(tb)
    version, steps = read_events(str(tb / first))
    assert version == "brain.Event:2" and sorted(steps) == [1, 2, 3]
    for i, step in enumerate(sorted(steps)):
        got = steps[step]
        assert set(got) == {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mib/max",
                            "peak_memory_mib/rank_0", "peak_memory_mib/rank_1"}, got
        assert got["loss"] == _f32(log["losses"][i])
        assert got["lr"] == _f32(log["learning_rates"][i]) and got["grad_norm"] == _f32(log["grad_norms"][i])
        assert got["tokens_per_s"] > 0 and math.isfinite(got["tokens_per_s"])
        ranks = [got["peak_memory_mib/rank_0"], got["peak_memory_mib/rank_1"]]
        assert min(ranks) > 50 and got["peak_memory_mib/max"] == max(ranks)  # a process with torch loaded
    assert log["learning_rates"] == [1e-2] * 3  # one warmup step: the peak from the first step on
    assert len(log["peak_memory_mib_per_rank"]) == 2 and log["max_grad_norm"] == 1.0
    assert all(n > 0 for n in log["grad_norms"])
    # resumed to 5 steps: a second file, its steps continuing; the first file kept
    assert train.main([*SHORT, "--steps", "5", "--out-dir", str(out), "--resume"]) == 0
    log = json.loads((out / "log.json").read_text())
    files = sorted(os.listdir(tb))
    assert len(files) == 2 and first in files
    (second,) = (f for f in files if f != first)
    _, later = read_events(str(tb / second))
    assert sorted(later) == [4, 5]
    assert [later[s]["loss"] for s in (4, 5)] == [_f32(x) for x in log["losses"][3:]]
