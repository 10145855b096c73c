"""Atomic, verified sharded checkpoints: DCP files inside a staging directory, a manifest, a rename.

``save_checkpoint(state_dict, root, step)`` (every rank calls it):

1. rank 0 draws the staging directory's name and shares it; every rank writes its own shards
   there through ``torch.distributed.checkpoint``, and fsyncs and checksums the files it wrote on
   a background thread while DCP's closing collectives run (``FileSeal``);
2. once every rank's files are sealed, the checksums reach rank 0, which writes
   ``manifest.json`` (every file's size and sha256, every tensor's global shape and dtype, and
   the caller's ``extra``) last, renames the directory to ``<root>/step-<N>`` and prunes to the
   newest ``keep``; the outcome reaches every rank.

A crash at any moment of it leaves the earlier checkpoints as they were, plus either nothing
usable or the complete new one: never a mix.  A save that fails (a full or read-only disk, a file
where the directory should be) raises one ``CheckpointError`` on every rank naming the path and
what to do, and removes its staging directory.  ``load_checkpoint`` first verifies (manifest,
sizes, and the checksums, spread over the ranks; then every tensor's global shape and dtype
against the state dict it loads into) and raises one ``CheckpointError`` on every rank naming the
file or tensor, before it reads any tensor.

Crash tests kill a rank at the moments ``hp_checkpoint.faults.FaultPoint`` names (off
unless ``HP_CHECKPOINT_FAULT`` is set).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from typing import Any

from hp_checkpoint.dcp import dcp_backend
from hp_checkpoint.faults import FAULT_ENV, FaultPoint, crash_point
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
    new_nonce,
    newest_complete,
    prune,
    staging_dir,
    step_name,
    verify_checkpoint,
    write_manifest,
)
from hp_dtensor.layout.shard_boxes import CheckpointError
from hp_dtensor.platform import current as dtensor_platform


def tensor_entries(state_dict: Mapping[str, Any], tensor_meta: Any) -> dict[str, TensorEntry]:
    """Global shape and dtype of every tensor in a nested state dict, keyed by its dotted path
    (dict keys and list indices), as DCP flattens it."""
    out: dict[str, TensorEntry] = {}

    def walk(prefix: str, value: Any) -> None:
        meta = tensor_meta(value)
        if meta is not None:
            out[prefix] = TensorEntry(shape=tuple(meta[0]), dtype=meta[1])
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)

    walk("", state_dict)
    return out


def save_checkpoint(
    state_dict: Mapping[str, Any],
    root: str,
    step: int,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = None,
    group: Any = None,
) -> str:
    """Save ``state_dict`` atomically as ``<root>/step-<N>`` (see the module doc); every rank
    calls it with the same ``step``, ``extra`` is rank 0's.  ``keep`` prunes to the newest ``keep``
    complete checkpoints afterwards (and removes directories of crashed saves).  Returns the
    checkpoint's path on every rank; raises ``CheckpointError`` on every rank when it failed.
    ``group``: the platform's process group for its collectives (default: every rank's)."""
    plat: Any = dtensor_platform()
    dcp = dcp_backend()
    rank = plat.get_rank()
    # rank 0 creates the root and the staging directory and shares the outcome with the nonce, so
    # a root that cannot be made (a file in the way, a read-only or full disk) fails on every rank
    opened: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        opened = _open_staging(root, step)
    nonce, failure = dcp.broadcast_object(opened, group=group)
    if failure is not None:
        raise CheckpointError(failure)
    stage = os.path.join(root, f".staging-{step_name(step)}-{nonce}")
    if rank != 0:
        with contextlib.suppress(OSError):  # on a filesystem of its own; DCP reports a failure to write
            staging_dir(root, step, nonce)
    crash_point(FaultPoint.STAGED, rank, step)
    error: str | None = None
    mine: dict[str, FileEntry] = {}
    try:
        mine = dict(dcp.write(dict(state_dict), stage, group=group))  # fsynced and checksummed
    except CheckpointError:  # raised on every rank alike, once every rank stopped writing
        if rank == 0:
            _discard(stage)
        raise
    except OSError as e:  # this rank's files written but not sealed: every rank learns it below
        error = describe_os_error(e, f"checkpoint save to {root}: rank {rank} cannot checksum its files")
    crash_point(FaultPoint.FILES_WRITTEN, rank, step)
    # every rank's tensors: ranks may hold different names (the stages of a pipeline)
    tensors = tensor_entries(state_dict, dcp.tensor_meta)
    gathered = dcp.all_gather_object((mine, error, tensors), group=group)
    outcome: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        outcome = _finish(plat.NAME, root, stage, step, gathered, extra, keep)
        if outcome[1] is not None:
            _discard(stage)  # every rank is done with it; a committed step is no longer there
    path, failure = dcp.broadcast_object(outcome, group=group)
    if failure is not None:
        raise CheckpointError(failure)
    assert path is not None
    return str(path)


def _open_staging(root: str, step: int) -> tuple[str | None, str | None]:
    """Rank 0: create ``root`` and this save's staging directory; ``(nonce, None)`` or
    ``(None, error)``."""
    try:
        step_name(step)
        if os.path.exists(root) and not os.path.isdir(root):
            return None, (f"checkpoint save of step {step}: the checkpoint directory {root} is a file, not a "
                          f"directory; pass a directory (it is created if missing), or move the file away")
        os.makedirs(root, exist_ok=True)
        nonce = new_nonce()
        staging_dir(root, step, nonce)
    except OSError as e:
        return None, describe_os_error(e, f"checkpoint save of step {step} cannot create its directory in {root}")
    except ValueError as e:
        return None, f"checkpoint save to {root}: {e}"
    return nonce, None


def _discard(stage: str) -> None:
    """Remove the staging directory of a save that failed (each failed retry would add one)."""
    shutil.rmtree(stage, ignore_errors=True)


def _finish(
    framework: str,
    root: str,
    stage: str,
    step: int,
    gathered: list[tuple[dict[str, FileEntry], str | None, dict[str, TensorEntry]]],
    extra: Mapping[str, Any] | None,
    keep: int | None,
) -> tuple[str | None, str | None]:
    """Rank 0: the manifest, the rename, the pruning; returns (path, None) or (None, error)."""
    errors = [e for _, e, _ in gathered if e is not None]
    if errors:
        return None, errors[0]
    files: dict[str, FileEntry] = {}
    tensors: dict[str, TensorEntry] = {}
    for r, (entries, _, held) in enumerate(gathered):
        files.update(entries)
        for fqn, entry in held.items():
            seen = tensors.setdefault(fqn, entry)
            if seen != entry:
                return None, (f"checkpoint save of step {step}: rank {r} holds {fqn!r} as {entry.dtype} of global shape "
                              f"{tuple(entry.shape)}, another rank as {seen.dtype} {tuple(seen.shape)}; one name "
                              f"must be one tensor on every rank that holds it")
    try:
        crash_point(FaultPoint.BEFORE_MANIFEST, 0, step)
        manifest = Manifest(
            framework=Framework(framework),
            kind=CheckpointKind.DCP,
            step=step,
            files=files,
            tensors=tensors,
            extra=dict(extra or {}),
        )
        write_manifest(stage, manifest)
        crash_point(FaultPoint.BEFORE_COMMIT, 0, step)
        path = commit(stage, root, step)
        crash_point(FaultPoint.AFTER_COMMIT, 0, step)
        if keep is not None:
            prune(root, keep)
    except OSError as e:
        return None, describe_os_error(e, f"checkpoint save of step {step} to {root} failed")
    except (TypeError, ValueError) as e:  # extra is not JSON
        return None, f"checkpoint save of step {step} to {root} failed: {type(e).__name__}: {e}"
    return path, None


def verify_sharded(path: str, state_dict: Mapping[str, Any] | None = None, *, strict: bool = True) -> Manifest:
    """Verify the checkpoint at ``path`` on every rank together: the manifest and file sizes on
    each, the checksums spread over the ranks, and (given ``state_dict``) every tensor's global
    shape and dtype.  Raises the same ``CheckpointError`` on every rank, naming the file or
    tensor; returns the manifest."""
    plat: Any = dtensor_platform()
    dcp = dcp_backend()
    rank, world = plat.get_rank(), plat.get_world_size()
    found: tuple[int, str] | None = None
    manifest: Manifest | None = None
    try:
        manifest = verify_checkpoint(path, check_hashes=False)
        if manifest.framework != plat.NAME or manifest.kind != CheckpointKind.DCP:
            raise CheckpointError(
                f"checkpoint {path} holds {manifest.kind} files written by {manifest.framework}; "
                f"this loads {CheckpointKind.DCP} checkpoints of {plat.NAME}"
            )
        check_checksums(path, manifest, share=(rank, world))
        if state_dict is not None:
            expected = {k: (v.shape, v.dtype) for k, v in tensor_entries(state_dict, dcp.tensor_meta).items()}
            check_tensors(manifest, expected, strict=strict, where=path)
    except CheckpointError as e:
        found = (0, str(e))
    except OSError as e:
        found = (1, f"checkpoint {path}: cannot read it: {e}")
    reports = dcp.all_gather_object(found)
    bad = [r for r in reports if r is not None]
    if bad:
        raise CheckpointError(min(bad)[1])
    assert manifest is not None
    return manifest


def load_checkpoint(state_dict: dict[str, Any], path: str, *, strict: bool = True) -> Manifest:
    """Verify the checkpoint at ``path`` (``verify_sharded``), then load it in place into
    ``state_dict`` under this run's layout (each rank reads only its slices).  Returns the
    manifest (its ``extra`` holds what the saver passed)."""
    manifest = verify_sharded(path, state_dict, strict=strict)
    dcp_backend().load(state_dict, path, strict=strict)
    return manifest


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """``(step, path)`` of the newest complete checkpoint under ``root``, or ``None``."""
    return newest_complete(root)


__all__ = [
    "FAULT_ENV", "FaultPoint", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "tensor_entries",
    "verify_sharded",
]
