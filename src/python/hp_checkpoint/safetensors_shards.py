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

A state dict may nest (``get_optimizer_state_dict``'s ``{"state": {fqn: {"exp_avg": ...}},
"param_groups": [...]}``): tensor leaves are saved under their dotted path, other leaves that
JSON holds (numbers, strings, bools, None) go into the manifest's ``extra["values"]`` and are put
back into the caller's dicts and lists on load; any other leaf is refused naming its path.  A
plain (non-DTensor) tensor is taken as the same on every rank and written once; every rank's
crc32 of it travels in the object gather and a tensor that differs is refused naming it.

Crash tests kill a rank at the moments ``hp_checkpoint.faults.FaultPoint`` names (off
unless ``HP_CHECKPOINT_FAULT`` is set).

The logic is written once here; a platform supplies only file primitives (``SHARD_FILES``:
write a dict of local tensors, open a file, read a slice of one entry) on top of the box
transfer primitives (``TRANSFER``: ranks, object gather, local tensors, dtype names).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import zlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Protocol

from hp_checkpoint.faults import FaultPoint, crash_point
from hp_checkpoint.gather_to_rank import check_tiling, local_entry, transfer_primitives
from hp_checkpoint.manifest import (
    CheckpointKind,
    FileEntry,
    Framework,
    Manifest,
    TensorEntry,
    check_checksums,
    check_tensors,
    commit,
    describe_os_error,
    file_entries,
    staging_dir,
    step_name,
    verify_checkpoint,
    write_manifest,
)
from hp_checkpoint.platform import feature
from hp_dtensor.layout.shard_boxes import CheckpointError, ShardBox, writes_box
from hp_dtensor.platform import current

Tensor = Any
class ShardFilePrimitives(Protocol):
    """safetensors I/O of one framework (``SHARD_FILES`` of ``hp_checkpoint.platform.<framework>``)."""

    def write(self, tensors: Mapping[str, Tensor], path: str) -> None: ...
    def open(self, path: str) -> AbstractContextManager[Any]: ...
    def read(self, handle: Any, key: str, start: Sequence[int], stop: Sequence[int]) -> Tensor: ...
    def crc32(self, t: Tensor) -> int: ...


def shard_file_primitives() -> ShardFilePrimitives:
    prims: ShardFilePrimitives = feature("SHARD_FILES", "safetensors-shards checkpoints")
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


_JSON_LEAVES = (bool, int, float, str, type(None))


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def flatten_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, values)`` keyed by dotted path (``state.w.exp_avg``, ``param_groups.0.lr``):
    tensor leaves and JSON leaves of a nested state dict.  Raises ``CheckpointError`` naming the
    path of a leaf of another type or of two leaves with the same path."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}

    def walk(path: str, value: Any) -> None:
        if path in tensors or path in values:
            raise CheckpointError(f"safetensors-shards: two entries of the state dict have the path {path!r}; "
                                  f"rename one")
        if _is_tensor(value):
            tensors[path] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str | int):
                    raise CheckpointError(f"safetensors-shards: key {k!r} under {path or 'the top'!r} is a "
                                          f"{type(k).__name__}; keys must be str or int")
                walk(f"{path}.{k}" if path else str(k), v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{path}.{i}", v)
        elif isinstance(value, _JSON_LEAVES):
            values[path] = value
        else:
            raise CheckpointError(f"safetensors-shards: entry {path!r} is a {type(value).__name__}, which is "
                                  f"neither a tensor, a dict, a list nor a JSON value (number, str, bool, None); "
                                  f"convert it or leave it out")

    if not isinstance(state, Mapping):
        raise CheckpointError(f"safetensors-shards: the state dict must be a mapping, got {type(state).__name__}")
    walk("", state)
    return tensors, values


def _json_value(value: Any) -> Any:
    """A float the JSON manifest keeps exactly (NaN and infinities as strings)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    return value


def save_shards(state: Mapping[str, Any], root: str, step: int, *, extra: Mapping[str, Any] | None = None) -> str:
    """Collective: write ``state`` (fqn -> DTensor or tensor) as the checkpoint ``<root>/step-<N>``
    atomically; returns its path.  ``extra`` (JSON) goes into the manifest's ``extra["user"]``."""
    prims = transfer_primitives()
    files = shard_file_primitives()
    rank, world = prims.rank(), prims.world_size()
    # checked before any rank writes, and the outcome shared with the nonce: a bad state dict,
    # name, step or root on any one rank fails on every rank (none is left waiting in a collective)
    problem: tuple[str, str] | None = None
    nonce: str | None = None
    try:
        step_name(step)
        state, values = flatten_state(state)
        for fqn, value in state.items():
            box_key(fqn, ())
            _check_dtype(prims, fqn, value)
        if os.path.exists(root) and not os.path.isdir(root):
            raise CheckpointError(f"safetensors-shards: the checkpoint root {root!r} is a file, not a directory; "
                                  f"pass a directory (it is created if missing)")
        if rank == 0:  # the staging directory, made once; a disk that refuses it fails every rank
            try:
                nonce = os.path.basename(staging_dir(root, step)).rsplit("-", 1)[1]
            except OSError as e:
                raise CheckpointError(describe_os_error(e, f"safetensors-shards: cannot create the staging "
                                                           f"directory in {root}")) from None
    except (CheckpointError, ValueError) as e:
        problem = (type(e).__name__, f"rank {rank}: {e}")
    gathered = prims.all_gather_object((nonce, problem))
    nonce = gathered[0][0]
    staging = os.path.join(root, f".staging-{step_name(step)}-{nonce}") if nonce is not None else ""
    try:
        _raise_first([part[1] for part in gathered])
    except (CheckpointError, ValueError):
        if rank == 0 and staging:  # another rank's problem: drop the directory made for nothing
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if rank != 0:
        with contextlib.suppress(OSError):  # on a filesystem of its own; its write reports a failure
            staging_dir(root, step, nonce)
    try:
        return _save_staged(prims, files, state, values, root, step, extra, staging, rank, world)
    except Exception:
        if rank == 0:  # raised on every rank alike once all stopped writing: drop what this save wrote
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _save_staged(prims: Any, files: ShardFilePrimitives, state: Mapping[str, Any], values: Mapping[str, Any],
                 root: str, step: int, extra: Mapping[str, Any] | None, staging: str, rank: int, world: int) -> str:
    """``save_shards`` once the staging directory exists: write, gather, manifest, commit."""
    crash_point(FaultPoint.STAGED, rank, step)
    mine: dict[str, Any] = {}
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    boxes: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []
    plain_crcs: dict[str, int] = {}
    name = shard_file_name(rank)
    for fqn in sorted(state):
        value = state[fqn]
        shape, dtype, box = local_entry(prims, fqn, value)
        entries[fqn] = (shape, dtype)
        if prims.spec_of(value) is None and world > 1:
            plain_crcs[fqn] = files.crc32(prims.local_of(value))
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
    except OSError as e:
        error = describe_os_error(e, f"rank {rank} could not write {name}")
    except (ValueError, TypeError) as e:
        error = f"rank {rank} could not write {name}: {type(e).__name__}: {e}"
    crash_point(FaultPoint.FILES_WRITTEN, rank, step)
    everyone = prims.all_gather_object((entries, boxes, written, error, plain_crcs))
    errors = [part[3] for part in everyone if part[3] is not None]
    if errors:
        raise CheckpointError(f"safetensors-shards save into {root} (step {step}) failed, nothing was committed: "
                              f"{errors[0]}")
    tensors, catalogue, all_files = _merge(everyone)
    _check_plain_equal(everyone, root, step)
    error = None
    if rank == 0:
        try:
            crash_point(FaultPoint.BEFORE_MANIFEST, rank, step)
            manifest = Manifest(
                framework=Framework(current().NAME), kind=CheckpointKind.SAFETENSORS_SHARDS, step=step,
                files=all_files, tensors=tensors,
                extra={"boxes": catalogue, "values": {k: _json_value(v) for k, v in values.items()},
                       "user": dict(extra or {})},
            )
            write_manifest(staging, manifest)
            crash_point(FaultPoint.BEFORE_COMMIT, rank, step)
            commit(staging, root, step)
            crash_point(FaultPoint.AFTER_COMMIT, rank, step)
        except OSError as e:
            error = describe_os_error(e, "rank 0 could not write the manifest or commit")
        except (ValueError, TypeError) as e:
            error = f"rank 0 could not write the manifest or commit: {type(e).__name__}: {e}"
    errors = [e for e in prims.all_gather_object(error) if e is not None]  # also the barrier after the commit
    if errors:
        raise CheckpointError(f"safetensors-shards save into {root} (step {step}) failed: {errors[0]}")
    crash_point(FaultPoint.RETURNING, rank, step)
    return os.path.join(root, f"step-{step:08d}")


def _merge(everyone: list[Any]) -> tuple[dict[str, TensorEntry], dict[str, list[dict[str, Any]]], dict[str, FileEntry]]:
    """The manifest's tensors, box catalogue and files from every rank's part (computed on every
    rank, so an inconsistent state dict is refused on all of them)."""
    tensors: dict[str, TensorEntry] = {}
    for rank, (entries, *_) in enumerate(everyone):
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
    for rank, (_, boxes, written, *_) in enumerate(everyone):
        for rel, (nbytes, sha) in written.items():
            files[rel] = FileEntry(bytes=nbytes, sha256=sha)
        for fqn, key, offsets, sizes in boxes:
            catalogue[fqn].append({"file": shard_file_name(rank), "key": key, "offsets": list(offsets),
                                   "sizes": list(sizes)})
    for fqn, entry in tensors.items():
        check_tiling(fqn, entry.shape, [ShardBox(tuple(b["offsets"]), tuple(b["sizes"])) for b in catalogue[fqn]
                                        if _numel(b["sizes"]) > 0], "safetensors-shards save: the boxes")
    return tensors, catalogue, files


def _check_dtype(prims: Any, fqn: str, value: Any) -> None:
    try:
        prims.dtype_name(value)
    except ValueError as e:
        raise ValueError(f"safetensors-shards: tensor {fqn!r}: {e}") from e


def _raise_first(problems: Sequence[tuple[str, str] | None]) -> None:
    """Raise, on this rank, the first rank's ``(exception type name, message)`` of ``problems``
    (one per rank, from an object gather), as a ``ValueError`` or a ``CheckpointError``."""
    for problem in problems:
        if problem is not None:
            kind, message = problem
            raise (ValueError if kind == "ValueError" else CheckpointError)(message)


def _check_plain_equal(everyone: list[Any], root: str, step: int) -> None:
    """A plain tensor is written by one rank for all: refuse (on every rank) one whose bytes
    differ between ranks, instead of saving one rank's copy as everyone's."""
    for fqn, crc in sorted(everyone[0][4].items()):
        differ = [r for r, part in enumerate(everyone) if part[4].get(fqn) != crc]
        if differ:
            raise CheckpointError(
                f"safetensors-shards save into {root} (step {step}): plain tensor {fqn!r} differs between ranks "
                f"(rank 0 vs ranks {differ}); a plain tensor is saved once for all ranks, so make it a DTensor "
                f"if each rank holds its own part, or make it equal everywhere; nothing was committed"
            )


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def verify_everywhere(directory: str) -> Manifest:
    """Collective: ``verify_checkpoint`` with sizes on every rank and the checksums spread over
    the ranks (each reads 1/world of the files); the lowest rank's failure is raised on every rank."""
    prims = transfer_primitives()
    manifest: Manifest | None = None
    error = None
    try:
        manifest = verify_checkpoint(directory, check_hashes=False)
        check_checksums(directory, manifest, share=(prims.rank(), prims.world_size()))
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
    rank's own slice, any layout), after verifying it; JSON leaves (``param_groups``' numbers) are
    put back into ``state``'s dicts and lists.  Tensors and values of ``state`` the checkpoint
    lacks are refused under ``strict`` (naming them), else left alone; entries of the checkpoint
    ``state`` does not ask for are not read.  Returns the manifest."""
    prims = transfer_primitives()
    files = shard_file_primitives()
    target = state
    manifest = verify_everywhere(directory)
    problem: tuple[str, str] | None = None
    try:  # every check before any read; a failure on any one rank is raised on every rank
        state, values = flatten_state(target)
        saved_values = manifest.extra.get("values", {})
        missing = sorted(k for k in values if k not in saved_values)
        if strict and missing:
            raise CheckpointError(f"checkpoint {directory} (step {manifest.step}) has no value {missing[0]!r} "
                                  f"({len(missing)} missing); pass strict=False to keep the state dict's own")
        restore = {k: _from_json(v) for k, v in saved_values.items() if k in values}
        _put_values(target, "", restore, apply=False)
        expected = {}
        for fqn, value in state.items():
            _check_dtype(prims, fqn, value)
            shape, dtype, _ = local_entry(prims, fqn, value)
            expected[fqn] = (shape, dtype)
        check_tensors(manifest, expected, strict=strict, where=directory)
        if not isinstance(manifest.extra.get("boxes"), dict):
            raise CheckpointError(f"checkpoint {directory}: manifest has no box catalogue (extra.boxes)")
    except (CheckpointError, ValueError) as e:
        problem = (type(e).__name__, str(e))
    _raise_first(prims.all_gather_object(problem))
    error = None
    try:
        _read_boxes(prims, files, state, directory, manifest, manifest.extra["boxes"])
    except Exception as e:  # noqa: BLE001  (raised on every rank below, not swallowed)
        error = f"{type(e).__name__}: {e}"
    errors = [e for e in prims.all_gather_object(error) if e is not None]
    if errors:
        raise CheckpointError(f"checkpoint {directory}: loading failed: {errors[0]}")
    _put_values(target, "", restore)
    return manifest


def _put_values(node: Any, path: str, saved: Mapping[str, Any], *, apply: bool = True) -> None:
    """Put the saved JSON leaves back into the caller's dicts and lists (same walk as
    ``flatten_state``); a leaf inside a tuple cannot change, so one the checkpoint holds
    otherwise is refused naming it rather than left silently stale."""
    items = node.items() if isinstance(node, Mapping) else enumerate(node)
    for k, v in list(items):
        sub = f"{path}.{k}" if path else str(k)
        if isinstance(v, Mapping | list | tuple) and not _is_tensor(v):
            _put_values(v, sub, saved, apply=apply)
        elif sub in saved and isinstance(node, dict | list):
            if apply:
                node[k] = saved[sub]
        elif sub in saved and not _same_value(v, saved[sub]):
            raise CheckpointError(f"checkpoint value {sub!r} is {saved[sub]!r} but the state dict holds {v!r} "
                                  f"inside a tuple or read-only mapping, which cannot be updated; use a list or dict")


def _same_value(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


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

