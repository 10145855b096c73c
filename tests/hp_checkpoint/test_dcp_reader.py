# mypy: disable-error-code="no-untyped-def"
"""The fast DCP reader's decoder against ``torch.load`` on one process.

Seeded generated tensors (dtypes, scalars, empty, non-contiguous views, views into a larger
storage), each ``torch.save``d as DCP stores an item; every decoded tensor must equal
``torch.load``'s bit for bit with the same dtype, shape, strides and storage offset, and items
repeating an earlier item's pickle must be rebuilt without unpickling (counted).  Then a whole
state dict through ``dcp.save`` and the reader, against torch's own ``FileSystemReader``."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
import torch

from hp_checkpoint.platform.torch.dcp_reader import FastFileSystemReader, _Decoder

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
CASES = 120

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape = tuple(rng.choice((0, 1, 3, 4)) for _ in range(rng.randrange(0, 4)))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    base = (torch.randn(shape, generator=g) * 50).to(dtype)
    kind = rng.choice(("plain", "transposed", "offset"))
    if kind == "transposed" and base.ndim >= 2:
        return base.transpose(0, 1)
    if kind == "offset" and base.numel() > 1:
        return base.reshape(-1)[1:]
    return base


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_decoder_matches_torch_load() -> None:
    rng = random.Random(1234)
    decode = _Decoder()
    seen: set[bytes] = set()
    repeats = 0
    for _ in range(CASES):
        data = _saved(_tensor(rng))
        want = torch.load(io.BytesIO(data), weights_only=True)
        got = decode(bytearray(data) if rng.random() < 0.5 else data)  # a view of a bytearray, or a copy
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
        assert torch.equal(got, want)
        pkl = [v for k, v in _records(data).items() if k.endswith("data.pkl")][0]
        repeats += pkl in seen
        seen.add(pkl)
    assert repeats > 20, repeats  # the generator repeats layouts, so the fast path is exercised
    assert decode.rebuilt == repeats and decode.unpickled == CASES - repeats
    print(f"dcp reader: {CASES} generated items, {decode.rebuilt} rebuilt, {decode.unpickled} unpickled")


def _records(data: bytes) -> dict[str, bytes]:
    reader = torch._C.PyTorchFileReader(io.BytesIO(data))
    return {r: reader.get_record(r) for r in reader.get_all_records()}


def test_reader_loads_what_torch_reader_loads(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    rng = random.Random(7)
    state: dict[str, Any] = {f"t{i}": _tensor(rng).contiguous() for i in range(40)}
    state["nested"] = {"step": torch.tensor(3.0), "blob": [1, "two"]}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)

    def empty() -> dict[str, Any]:
        out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        out["nested"] = {"step": torch.tensor(0.0), "blob": None}
        return out

    ours, theirs = empty(), empty()
    dcp.load(ours, storage_reader=FastFileSystemReader(str(tmp_path)), no_dist=True)
    dcp.load(theirs, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(ours[k], v) and torch.equal(theirs[k], v), k
    assert torch.equal(ours["nested"]["step"], torch.tensor(3.0))
    assert ours["nested"]["blob"] == theirs["nested"]["blob"] == [1, "two"]
