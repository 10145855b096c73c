"""A framework-neutral sharded checkpoint: one safetensors file of boxes per rank, plus the manifest.

Save: every rank writes the boxes it holds of each tensor (replicas once, as ``writes_box``
picks; a plain tensor counts as replicated over the world) to ``shard-rank<r>.safetensors``,
each under the key ``<fqn>|<offsets>`` (``model.w|0,128``).  The files go into a staging
directory and are fsynced; the ranks exchange their boxes and file checksums in one object
gather; rank 0 writes ``manifest.json`` (kind ``safetensors-shards``: every tensor's global shape
and dtype, every file's size and sha256, and in ``extra["boxes"]`` each box's file, key,
offsets and sizes) and renames the directory into place.  Nothing a crash leaves behind loads.

Load, under any layout: the checkpoint is verified first (every listed file present with its
size on every rank, checksums on rank 0; any failure is raised on every rank), the state dict's
global shapes and dtypes are checked against the manifest naming the tensor, then each rank
reads, through safetensors slice reads, only the parts of the saved boxes that overlap the
slice it holds.  The files are plain safetensors, so torch and MindSpore read each other's.

The logic is written once here; a platform supplies only file primitives (``SHARD_FILES``:
write a dict of local tensors, open a file, read a slice of one entry) on top of the box
transfer primitives (``TRANSFER``: ranks, object gather, local tensors, dtype names).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Protocol

from hp_dtensor.checkpoint_layout import CheckpointError, ShardBox, writes_box
from hp_dtensor.checkpoint_manifest import (
    CheckpointKind,
    FileEntry,
    Framework,
    Manifest,
    TensorEntry,
    check_tensors,
    commit,
    file_entries,
    new_nonce,
    staging_dir,
    verify_checkpoint,
    write_manifest,
)
from hp_dtensor.gather_to_rank import check_tiling, local_entry, transfer_primitives
from hp_dtensor.platform import backend_primitives, current

Tensor = Any


class ShardFilePrimitives(Protocol):
    """safetensors I/O of one framework (``platform.current().SHARD_FILES``)."""

    def write(self, tensors: Mapping[str, Tensor], path: str) -> None: ...
    def open(self, path: str) -> AbstractContextManager[Any]: ...
    def read(self, handle: Any, key: str, start: Sequence[int], stop: Sequence[int]) -> Tensor: ...


def shard_file_primitives() -> ShardFilePrimitives:
    prims: ShardFilePrimitives = backend_primitives(
        "SHARD_FILES", "safetensors-shards checkpoints", "use the torch or mindspore backend"
    )
    return prims


def shard_file_name(rank: int) -> str:
    return f"shard-rank{rank:05d}.safetensors"


def box_key(fqn: str, offsets: Sequence[int]) -> str:
    """The safetensors entry name of the box of ``fqn`` starting at ``offsets``."""
    if "|" in fqn:
        raise CheckpointError(f"safetensors-shards: tensor name {fqn!r} contains '|', which separates the offsets")
    return f"{fqn}|{','.join(str(o) for o in offsets)}"


def _writes(prims: Any, fqn: str, value: Any, box: ShardBox | None, rank: int, world: int) -> bool:
    spec = prims.spec_of(value)
    if spec is None:  # a plain tensor is taken as replicated over the world: one rank writes it
        return rank == zlib.crc32(fqn.encode("utf-8")) % world
    coord = spec.mesh.get_coordinate()
    return box is not None and coord is not None and writes_box(
        fqn, spec.shape, spec.mesh.shape, spec.placements, coord
    )


def save_shards(state: Mapping[str, Any], root: str, step: int, *, extra: Mapping[str, Any] | None = None) -> str:
    """Collective: write ``state`` (fqn -> DTensor or tensor) as the checkpoint ``<root>/step-<N>``
    atomically; returns its path.  ``extra`` (JSON) goes into the manifest's ``extra["user"]``."""
    prims = transfer_primitives()
    files = shard_file_primitives()
    rank, world = prims.rank(), prims.world_size()
    nonce = prims.all_gather_object(new_nonce() if rank == 0 else None)[0]
    staging = staging_dir(root, step, nonce)
    for fqn in state:  # on every rank, before any rank writes: a bad name fails everywhere
        box_key(fqn, ())
    mine: dict[str, Any] = {}
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    boxes: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []
    name = shard_file_name(rank)
    for fqn in sorted(state):
        value = state[fqn]
        shape, dtype, box = local_entry(prims, fqn, value)
        entries[fqn] = (shape, dtype)
        if box is None or not _writes(prims, fqn, value, box, rank, world):
            continue
        key = box_key(fqn, box.offsets)
        mine[key] = prims.local_of(value)
        boxes.append((fqn, key, box.offsets, box.sizes))
    written: dict[str, Any] = {}
    error = None
    try:  # a failure here (disk full, a dtype the file format lacks) is raised on every rank below
        files.write(mine, os.path.join(staging, name))
        written = {k: (v.bytes, v.sha256) for k, v in file_entries(staging, [name]).items()}
    except (OSError, ValueError, TypeError) as e:
        error = f"rank {rank} could not write {name}: {type(e).__name__}: {e}"
    everyone = prims.all_gather_object((entries, boxes, written, error))
    errors = [part[3] for part in everyone if part[3] is not None]
    if errors:
        raise CheckpointError(f"safetensors-shards save into {root} (step {step}) failed, nothing was committed: "
                              f"{errors[0]}")
    tensors, catalogue, all_files = _merge(everyone)
    error = None
    if rank == 0:
        try:
            manifest = Manifest(
                framework=Framework(current().NAME), kind=CheckpointKind.SAFETENSORS_SHARDS, step=step,
                files=all_files, tensors=tensors, extra={"boxes": catalogue, "user": dict(extra or {})},
            )
            write_manifest(staging, manifest)
            commit(staging, root, step)
        except (OSError, ValueError, TypeError) as e:
            error = f"rank 0 could not write the manifest or commit: {type(e).__name__}: {e}"
    errors = [e for e in prims.all_gather_object(error) if e is not None]  # also the barrier after the commit
    if errors:
        raise CheckpointError(f"safetensors-shards save into {root} (step {step}) failed: {errors[0]}")
    return os.path.join(root, f"step-{step:08d}")


def _merge(everyone: list[Any]) -> tuple[dict[str, TensorEntry], dict[str, list[dict[str, Any]]], dict[str, FileEntry]]:
    """The manifest's tensors, box catalogue and files from every rank's part (computed on every
    rank, so an inconsistent state dict is refused on all of them)."""
    tensors: dict[str, TensorEntry] = {}
    for rank, (entries, _, _, _) in enumerate(everyone):
        if sorted(entries) != sorted(everyone[0][0]):
            diff = sorted(set(entries) ^ set(everyone[0][0]))
            raise CheckpointError(f"safetensors-shards save: rank {rank} holds other tensors than rank 0: {diff[:8]}")
        for fqn, (shape, dtype) in entries.items():
            entry = TensorEntry(shape=tuple(shape), dtype=dtype)
            if tensors.setdefault(fqn, entry) != entry:
                raise CheckpointError(
                    f"safetensors-shards save: tensor {fqn!r} is {tensors[fqn]} on rank 0 but {entry} on rank {rank}"
                )
    catalogue: dict[str, list[dict[str, Any]]] = {fqn: [] for fqn in tensors}
    files: dict[str, FileEntry] = {}
    for rank, (_, boxes, written, _) in enumerate(everyone):
        for rel, (nbytes, sha) in written.items():
            files[rel] = FileEntry(bytes=nbytes, sha256=sha)
        for fqn, key, offsets, sizes in boxes:
            catalogue[fqn].append({"file": shard_file_name(rank), "key": key, "offsets": list(offsets),
                                   "sizes": list(sizes)})
    for fqn, entry in tensors.items():
        check_tiling(fqn, entry.shape, [ShardBox(tuple(b["offsets"]), tuple(b["sizes"])) for b in catalogue[fqn]
                                        if _numel(b["sizes"]) > 0], "safetensors-shards save: the boxes")
    return tensors, catalogue, files


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def verify_everywhere(directory: str) -> Manifest:
    """Collective: ``verify_checkpoint`` with sizes on every rank and checksums on rank 0; the
    first failure is raised on every rank."""
    prims = transfer_primitives()
    manifest: Manifest | None = None
    error = None
    try:
        manifest = verify_checkpoint(directory, check_hashes=prims.rank() == 0)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in prims.all_gather_object(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    assert manifest is not None
    if manifest.kind != CheckpointKind.SAFETENSORS_SHARDS:
        raise CheckpointError(f"checkpoint {directory} is of kind {manifest.kind!s}, not safetensors-shards; "
                              f"load it with the loader of its kind")
    return manifest


def load_shards(state: Mapping[str, Any], directory: str, *, strict: bool = True) -> Manifest:
    """Collective: load the checkpoint in ``directory`` in place into ``state``'s tensors (each
    rank's own slice, any layout), after verifying it.  Tensors of ``state`` the checkpoint lacks
    are refused under ``strict`` (naming them), else left alone.  Returns the manifest."""
    prims = transfer_primitives()
    files = shard_file_primitives()
    manifest = verify_everywhere(directory)
    expected = {}
    for fqn, value in state.items():
        shape, dtype, _ = local_entry(prims, fqn, value)
        expected[fqn] = (shape, dtype)
    check_tensors(manifest, expected, strict=strict, where=directory)
    catalogue = manifest.extra.get("boxes")
    if not isinstance(catalogue, dict):
        raise CheckpointError(f"checkpoint {directory}: manifest has no box catalogue (extra.boxes)")
    error = None
    try:
        _read_boxes(prims, files, state, directory, manifest, catalogue)
    except Exception as e:  # noqa: BLE001  (raised on every rank below, not swallowed)
        error = f"{type(e).__name__}: {e}"
    errors = [e for e in prims.all_gather_object(error) if e is not None]
    if errors:
        raise CheckpointError(f"checkpoint {directory}: loading failed: {errors[0]}")
    return manifest


def _read_boxes(prims: Any, files: ShardFilePrimitives, state: Mapping[str, Any], directory: str,
                manifest: Manifest, catalogue: Mapping[str, Any]) -> None:
    """Copy into each tensor of ``state`` the parts of the saved boxes overlapping its slice."""
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for fqn in sorted(state):
            if fqn not in manifest.tensors:
                continue
            value = state[fqn]
            _, _, mine = local_entry(prims, fqn, value)
            if mine is None or mine.numel == 0:
                continue
            local = prims.local_of(value)
            filled = 0
            for saved in catalogue.get(fqn, []):
                lo = [max(a, b) for a, b in zip(mine.offsets, saved["offsets"])]
                hi = [min(a + s, b + t) for a, s, b, t in zip(mine.offsets, mine.sizes, saved["offsets"], saved["sizes"])]
                if any(h <= low for low, h in zip(lo, hi)) and mine.offsets:
                    continue
                if saved["file"] not in handles:
                    handles[saved["file"]] = stack.enter_context(files.open(os.path.join(directory, saved["file"])))
                piece = files.read(
                    handles[saved["file"]], saved["key"],
                    [a - b for a, b in zip(lo, saved["offsets"])], [a - b for a, b in zip(hi, saved["offsets"])],
                )
                prims.put_box(local, [a - b for a, b in zip(lo, mine.offsets)], piece)
                filled += _numel([h - low for low, h in zip(lo, hi)])
            if filled != mine.numel:
                raise CheckpointError(
                    f"checkpoint {directory}: the saved boxes of tensor {fqn!r} cover {filled} of the "
                    f"{mine.numel} elements this rank holds; the box catalogue is damaged"
                )

