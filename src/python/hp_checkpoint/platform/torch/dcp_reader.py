"""A DCP file reader that decodes each saved tensor without a full ``torch.load``.

DCP's ``FileSystemWriter`` stores every tensor item as its own ``torch.save`` archive, and its
``FileSystemReader`` runs one ``torch.load`` (the weights-only unpickler, a zip reader over a
Python file view) per item: with a few hundred items per rank that, not the bytes, is most of a
load.  The archives of one checkpoint repeat few pickles: items of the same dtype, shape and
strides pickle to the same bytes and differ only in their storage record.  So this reader

- reads each item's bytes with one ``readinto`` (items in file order), and
- runs the real ``torch.load(weights_only=True)`` on the first item of each distinct pickle,
  remembering the tensor it describes (storage record, dtype, storage size, offset, size,
  strides); an item whose pickle and byte order are byte-for-byte the same is rebuilt from its
  own storage record with that description, which is exactly what the unpickler would build
  (a view of the bytes read, which DCP then copies into the target: one copy, not two).

Anything unusual (more than one storage record, a foreign byte order, stream transforms) goes
through ``torch.load`` as before.  The files stay DCP's standard format.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_PICKLE = "data.pkl"
_BYTEORDER = "byteorder"


@dataclass(frozen=True)
class _TensorLayout:
    """What one ``torch.save`` pickle of a plain CPU tensor describes."""

    record: str  # the storage record's name below the archive prefix, e.g. "data/0"
    dtype: torch.dtype
    nbytes: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Decoder:
    """Decodes ``torch.save`` archives of single tensors, unpickling each distinct pickle once."""

    def __init__(self) -> None:
        self._layouts: dict[bytes, _TensorLayout | None] = {}
        self.unpickled = 0  # items decoded by torch.load
        self.rebuilt = 0  # items rebuilt from a remembered layout

    def __call__(self, data: bytes | bytearray) -> torch.Tensor:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = reader.get_all_records()
        pickles = [r for r in records if r == _PICKLE or r.endswith("/" + _PICKLE)]
        if len(pickles) != 1:
            return self._full_load(data)
        prefix = pickles[0][: -len(_PICKLE)]
        if prefix + _BYTEORDER in records and reader.get_record(prefix + _BYTEORDER) != sys.byteorder.encode():
            return self._full_load(data)
        storages = [r[len(prefix):] for r in records if r.startswith(prefix + "data/")]
        if len(storages) != 1:
            return self._full_load(data)
        key = reader.get_record(pickles[0])
        if key not in self._layouts:
            tensor = self._full_load(data)
            self._layouts[key] = self._layout_of(tensor, storages[0])
            return tensor
        layout = self._layouts[key]
        if layout is None or layout.record != storages[0]:
            return self._full_load(data)
        name = prefix + layout.record
        if reader.get_record_size(name) != layout.nbytes:
            return self._full_load(data)
        self.rebuilt += 1
        start = int(reader.get_record_offset(name))  # type: ignore[attr-defined]  # exists, not in torch's stubs
        if isinstance(data, bytearray) and layout.nbytes and start % layout.dtype.itemsize == 0:
            # a view of the bytes just read (the caller copies it into its target): no copy here
            flat = torch.frombuffer(data, dtype=torch.uint8, count=layout.nbytes, offset=start)
            return flat.view(layout.dtype).as_strided(layout.size, layout.stride, layout.offset)
        storage = reader.get_storage_from_record(name, layout.nbytes, torch.uint8)
        untyped = storage._typed_storage()._untyped_storage
        return torch.empty((0,), dtype=layout.dtype).set_(untyped, layout.offset, layout.size, layout.stride)

    def _full_load(self, data: bytes | bytearray) -> torch.Tensor:
        self.unpickled += 1
        out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"a DCP tensor item unpickled to {type(out).__name__}, not a tensor")
        return out

    @staticmethod
    def _layout_of(tensor: torch.Tensor, record: str) -> _TensorLayout | None:
        """The description to rebuild tensors of this pickle, or ``None`` when the pickle holds
        more than a plain tensor over one storage (those always go through ``torch.load``)."""
        if type(tensor) is not torch.Tensor or tensor.requires_grad or tensor.device.type != "cpu":
            return None
        if tensor.is_quantized or tensor.is_sparse or tensor.is_conj() or tensor.is_neg():
            return None
        return _TensorLayout(
            record=record,
            dtype=tensor.dtype,
            nbytes=tensor.untyped_storage().nbytes(),
            offset=int(tensor.storage_offset()),
            size=tuple(int(n) for n in tensor.shape),
            stride=tuple(int(n) for n in tensor.stride()),
        )


class FastFileSystemReader(FileSystemReader):
    """``FileSystemReader`` with one ``read`` per item and the ``_Decoder`` above."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(self.storage_data[item.storage_index].transform_descriptors for item in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        decode = _Decoder()
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    stream.seek(info.offset)
                    data = bytearray(info.length)
                    got = stream.readinto(data)  # type: ignore[attr-defined]  # a binary file opened "rb"
                    if got != info.length:
                        raise OSError(
                            f"{relative_path}: item {req.storage_index.fqn!r} needs {info.length} bytes at "
                            f"offset {info.offset}, the file ends after {got}"
                        )
                    self._deliver(req, data, planner, decode)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _deliver(req: ReadItem, data: bytearray, planner: LoadPlanner, decode: Any) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = narrow_tensor_by_index(decode(data), req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
