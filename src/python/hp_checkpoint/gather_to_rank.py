"""Materialize whole tensors on one chosen rank only, from the boxes the ranks hold.

``full_tensor()`` builds the whole tensor on every rank of its mesh; an export that must not hold
the model on any one rank needs each tensor whole on its writer only.  Every rank first tells
every other one, in one object gather, which box of each tensor it holds (DTensors: the box of
its mesh coordinate; plain tensors: the whole tensor), so the plan does not depend on how the
meshes were built (one world mesh, or several sub-meshes each holding a replica).  For each
tensor the plan keeps one holder per distinct box (the destination itself when it holds the box,
so nothing moves; else a holder picked by a stable hash of the key) and checks that the boxes
tile the global tensor.  Each box then moves between its two ends only: ``move_box`` is called by
the holder and the destination alone (torch: a send and a receive; MindSpore, whose CPU collectives
have no point-to-point: a broadcast inside a group of the two ranks), and the destination copies it
into place, so no third rank ever holds any of it.  All ranks walk the tensors and their boxes in
the same order, so the lowest unfinished transfer always has both its ends ready and nothing
deadlocks (a pair's group is created by its two ranks at their first transfer, in that order too).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hp_checkpoint.platform import feature
from hp_dtensor.layout.dtensor_spec import DTensorSpec
from hp_dtensor.layout.shard_boxes import CheckpointError, ShardBox, check_no_partial, shard_box
from hp_dtensor.platform import current

Tensor = Any  # the framework's tensor type


class TransferPrimitives(Protocol):
    """What moving boxes between ranks needs from a framework (``TRANSFER`` of ``hp_checkpoint.platform.<framework>``)."""

    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def spec_of(self, t: Tensor) -> DTensorSpec | None: ...
    def local_of(self, t: Tensor) -> Tensor: ...
    def shape_of(self, t: Tensor) -> tuple[int, ...]: ...
    def dtype_name(self, t: Tensor) -> str: ...
    def itemsize(self, dtype_name: str) -> int: ...
    def empty(self, shape: Sequence[int], dtype_name: str) -> Tensor: ...
    def put_box(self, buf: Tensor, offsets: Sequence[int], piece: Tensor) -> None: ...
    def move_box(self, piece: Tensor | None, shape: Sequence[int], dtype_name: str, src: int, dst: int) -> Tensor | None:
        """Collective over the two ranks ``src`` and ``dst`` (``src != dst``), called by both and
        no other: ``src`` passes its ``piece`` (``shape``, ``dtype_name``) and gets ``None``;
        ``dst`` passes ``None`` and gets a new tensor with the piece's values, bit for bit."""
        ...


class TransferBase:
    """The part of ``TransferPrimitives`` that is the same on every backend: this rank, the world
    size, an object gather over every rank through the backend's collectives module (``[obj]`` in a
    world of one, which needs no process group), a tensor's spec and shape.  Backends' ``TRANSFER``
    objects inherit it and add the framework's tensor primitives."""

    @staticmethod
    def spec_of(t: Tensor) -> DTensorSpec | None:
        return t._spec if isinstance(t, current().DTensor) else None  # type: ignore[no-any-return]

    @staticmethod
    def shape_of(t: Tensor) -> tuple[int, ...]:
        return tuple(int(n) for n in t.shape)

    @staticmethod
    def rank() -> int:
        return current().get_rank()

    @staticmethod
    def world_size() -> int:
        return current().get_world_size()

    @staticmethod
    def all_gather_object(obj: Any) -> list[Any]:
        plat = current()
        n = plat.get_world_size()
        if n == 1:
            return [obj]
        world = plat.get_or_create_group(tuple(range(n)))
        return plat.COLLECTIVES.all_gather_object(obj, world, n, plat.get_rank())


def transfer_primitives() -> TransferPrimitives:
    prims: TransferPrimitives = feature("TRANSFER", "gathering tensors to one rank")
    return prims


@dataclass(frozen=True)
class TensorSources:
    """A tensor's global shape and dtype, and for each distinct non-empty box the rank sending it."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    senders: tuple[tuple[ShardBox, int], ...]

    def nbytes(self, itemsize: int) -> int:
        n = itemsize
        for s in self.shape:
            n *= s
        return n


def local_entry(prims: TransferPrimitives, key: str, value: Any) -> tuple[tuple[int, ...], str, ShardBox | None]:
    """(global shape, dtype name, the box this rank holds or None): a plain tensor is whole."""
    spec = prims.spec_of(value)
    dtype = prims.dtype_name(value)
    if spec is None:
        shape = prims.shape_of(value)
        return shape, dtype, ShardBox(offsets=(0,) * len(shape), sizes=shape)
    check_no_partial(key, spec.placements)
    coord = spec.mesh.get_coordinate()
    if coord is None:  # this rank is outside the tensor's mesh: it holds nothing
        return tuple(spec.shape), dtype, None
    return tuple(spec.shape), dtype, shard_box(spec.shape, spec.mesh.shape, spec.placements, coord)


def _overlap(a: ShardBox, b: ShardBox) -> bool:
    return all(
        max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def check_tiling(key: str, shape: Sequence[int], boxes: Sequence[ShardBox], what: str) -> None:
    """Raise ``CheckpointError`` naming ``key`` unless the distinct ``boxes`` lie inside ``shape``,
    do not overlap, and cover every element of it."""
    for b in boxes:
        if len(b.offsets) != len(shape) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(b.offsets, b.sizes, shape)
        ):
            raise CheckpointError(f"{what} of tensor {key!r}: box {b} does not fit its global shape {tuple(shape)}")
    ordered = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if _overlap(a, b):
                raise CheckpointError(f"{what} of tensor {key!r} overlap: {a} and {b}")
    total = 1
    for s in shape:
        total *= s
    covered = sum(b.numel for b in boxes)
    if covered != total:
        raise CheckpointError(
            f"{what} of tensor {key!r} cover {covered} of its {total} elements (global shape {tuple(shape)}); "
            f"every element must be held by exactly one box"
        )


def plan_sources(state: Mapping[str, Any], dst_of: Mapping[str, int]) -> dict[str, TensorSources]:
    """Collective (every rank, same keys): who sends which box of each tensor to ``dst_of[key]``.
    Raises ``CheckpointError`` on every rank, naming the tensor, when ranks disagree on its
    global shape or dtype, hold no box of part of it, or hold overlapping different boxes."""
    prims = transfer_primitives()
    mine = {key: local_entry(prims, key, value) for key, value in state.items()}
    everyone = prims.all_gather_object(mine)
    key_sets = [sorted(d) for d in everyone]
    if any(ks != key_sets[0] for ks in key_sets):
        diff = sorted(set().union(*map(set, key_sets)) - set.intersection(*map(set, key_sets)))
        raise CheckpointError(f"gather: the ranks hold different tensors; not on every rank: {diff[:8]}")
    out: dict[str, TensorSources] = {}
    for key in key_sets[0]:
        shapes = {(d[key][0], d[key][1]) for d in everyone}
        if len(shapes) != 1:
            raise CheckpointError(
                f"gather: tensor {key!r} has different global (shape, dtype) on different ranks: {sorted(shapes)}"
            )
        ((shape, dtype),) = shapes
        holders: dict[ShardBox, list[int]] = {}
        for rank, d in enumerate(everyone):
            box = d[key][2]
            if box is not None and box.numel > 0:
                holders.setdefault(box, []).append(rank)
        boxes = sorted(holders, key=lambda b: b.offsets)
        check_tiling(key, shape, boxes, "gather: the ranks' boxes")
        dst = dst_of[key]
        senders = []
        for box in boxes:
            ranks = holders[box]
            senders.append((box, dst if dst in ranks else ranks[zlib.crc32(key.encode("utf-8")) % len(ranks)]))
        out[key] = TensorSources(key=key, shape=shape, dtype=dtype, senders=tuple(senders))
    return out


def gather_to(value: Any, sources: TensorSources, dst: int) -> Tensor | None:
    """Collective over the ranks named in ``sources`` and ``dst``: the whole tensor on ``dst``
    (a new tensor), ``None`` elsewhere.  Every rank calls it for the same tensors in the same order."""
    prims = transfer_primitives()
    me = prims.rank()
    if me == dst:
        buf = prims.empty(sources.shape, sources.dtype)
        for box, src in sources.senders:
            if src == me:  # a rank's box is its local tensor (a plain tensor's box is all of it)
                piece = prims.local_of(value)
            else:
                piece = prims.move_box(None, box.sizes, sources.dtype, src, dst)
            prims.put_box(buf, box.offsets, piece)
        return buf
    for box, src in sources.senders:
        if src == me:
            prims.move_box(prims.local_of(value), box.sizes, sources.dtype, src, dst)
    return None

