"""Atomic, verified checkpoint directories: staging, manifest with checksums, commit, pruning.

A checkpoint root holds complete checkpoints ``<root>/step-<N>/`` (``N`` zero-padded to 8 digits
so names sort).  A save writes into ``<root>/.staging-step-<N>-<nonce>/`` on the same filesystem,
fsyncs every file, writes ``manifest.json`` LAST (fsynced), renames the staging directory to
``step-<N>`` and fsyncs the root.  A crash at any moment therefore leaves either the previous
complete checkpoints alone or the new one complete as well; a directory without a valid
manifest is never loaded.  The manifest records every file's size and sha256 (a load verifies
them before using anything), every tensor's global shape and dtype (a load refuses a tensor
that does not fit, naming it) and the sha256 of its own content, so an edit of the manifest
itself (a digit of ``extra``) is refused too.  A checkpoint counts as complete only when its
manifest verifies and every file it lists is present with its size; pruning renames a step out
of the ``step-<N>`` namespace before deleting its files, so a half-deleted step is never listed.

Pure Python (json, hashlib, os): both frameworks' checkpoint formats share it.  ``manifest.json``::

    {"format": "hyper-parallel-checkpoint", "version": 1, "framework": "torch" | "mindspore",
     "kind": "dcp" | "safetensors-shards", "step": N,
     "files": {relpath: {"bytes": int, "sha256": hex}},
     "tensors": {fqn: {"shape": [...], "dtype": "float32" | "bfloat16" | ...}},
     "extra": {...},
     "manifest_sha256": hex}   # of the canonical JSON of every other field

dtype names are framework-neutral lowercase strings (``float32``, ``bfloat16``, ``int64``, ...).
"""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hp_checkpoint.faults import FaultPoint, crash_point
from hp_dtensor.layout.shard_boxes import CheckpointError

FORMAT = "hyper-parallel-checkpoint"
VERSION = 1
MANIFEST_NAME = "manifest.json"
STEP_DIGITS = 8

_STEP_RE = re.compile(r"^step-(\d{8})$")
_STAGING_PREFIX = ".staging-step-"
_TRASH_PREFIX = ".trash-step-"
_TRASH_RE = re.compile(r"^\.trash-step-(\d{8})-[0-9A-Za-z]+$")
_PRUNED_PREFIX = ".pruned-step-"
SELF_CHECKSUM = "manifest_sha256"
_CHUNK = 1 << 20


class Framework(enum.StrEnum):
    """Which framework wrote a checkpoint."""

    TORCH = "torch"
    MINDSPORE = "mindspore"


class CheckpointKind(enum.StrEnum):
    """How the tensors are stored: a ``torch.distributed.checkpoint`` directory, or one
    safetensors file of shards per rank."""

    DCP = "dcp"
    SAFETENSORS_SHARDS = "safetensors-shards"


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint: its size in bytes and the sha256 of its contents (hex)."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: its global shape and neutral dtype name."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds; ``manifest.json`` is its JSON form."""

    framework: Framework
    kind: CheckpointKind
    step: int
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, TensorEntry] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "framework": str(Framework(self.framework)),
            "kind": str(CheckpointKind(self.kind)),
            "step": self.step,
            "files": {k: {"bytes": v.bytes, "sha256": v.sha256} for k, v in sorted(self.files.items())},
            "tensors": {k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in sorted(self.tensors.items())},
            "extra": dict(self.extra),
        }


# ---------------------------------------------------------------------------------------------
# files


def fsync_file(path: str) -> None:
    """Flush ``path``'s contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (creations, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_entry(path: str) -> FileEntry:
    """Size and sha256 of ``path``, read in 1 MiB chunks (never the whole file in memory)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return FileEntry(bytes=n, sha256=h.hexdigest())


def file_entries(directory: str, relpaths: Iterable[str], *, fsync: bool = True) -> dict[str, FileEntry]:
    """``file_entry`` of each ``relpath`` under ``directory`` (fsynced first unless told not to):
    what one rank contributes to the manifest for the files it wrote."""
    out = {}
    for rel in relpaths:
        path = os.path.join(directory, checked_relpath(rel, directory))
        if fsync:
            fsync_file(path)
        out[rel] = file_entry(path)
    return out


def checked_relpath(rel: str, where: str) -> str:
    """A manifest path must stay inside the checkpoint directory."""
    norm = os.path.normpath(rel)
    if not rel or os.path.isabs(rel) or norm.startswith("..") or norm != rel or rel == MANIFEST_NAME:
        raise CheckpointError(
            f"checkpoint {where}: manifest lists file {rel!r}, which is not a plain relative path inside "
            f"the checkpoint directory; the manifest is damaged, use another checkpoint"
        )
    return rel


# ---------------------------------------------------------------------------------------------
# the manifest


def write_manifest(staging_dir: str, manifest: Manifest) -> str:
    """Write ``manifest.json`` into ``staging_dir`` (through a temporary file, fsynced, renamed)
    and fsync the directory.  Call it after every listed file is written and fsynced."""
    for rel in manifest.files:
        checked_relpath(rel, staging_dir)
    path = os.path.join(staging_dir, MANIFEST_NAME)
    tmp = path + ".tmp"
    doc = json.loads(json.dumps(manifest.to_json()))  # as a reader will parse it (tuples, int keys)
    doc[SELF_CHECKSUM] = _self_checksum(doc)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(staging_dir)
    return path


def _self_checksum(doc: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of every field but the checksum:
    the same however the file is laid out, different after any change of a value."""
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _bad(directory: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {directory}: {MANIFEST_NAME} {what}; the checkpoint is damaged or was not written "
        f"by this library: use another checkpoint"
    )


def _field(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], directory: str, where: str) -> Any:
    at = f" {where}" if where else ""
    if key not in obj:
        raise _bad(directory, f"has no {key!r}{at}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(directory, f"has {key!r}{at} of type {type(value).__name__}: {value!r:.80}")
    return value


def read_manifest(directory: str) -> Manifest:
    """Parse ``<directory>/manifest.json``; raises ``CheckpointError`` when it is missing (the save
    never finished), not JSON, not a manifest of a format version this library reads, or edited
    after it was written (its own sha256 differs)."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory}: no such directory")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {directory}: no {MANIFEST_NAME}, so the save that wrote it did not finish; "
            f"it is incomplete and is never loaded: use an earlier checkpoint"
        ) from None
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(directory, f"is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _bad(directory, f"is a JSON {type(raw).__name__}, not an object")
    if raw.get("format") != FORMAT:
        raise _bad(directory, f"has format {raw.get('format')!r}, expected {FORMAT!r}")
    version = _field(raw, "version", int, directory, "")
    if version != VERSION:
        raise CheckpointError(
            f"checkpoint {directory}: {MANIFEST_NAME} is format version {version}; this library reads "
            f"version {VERSION}: use the library version that wrote it"
        )
    framework_s = _field(raw, "framework", str, directory, "")
    kind_s = _field(raw, "kind", str, directory, "")
    try:
        framework = Framework(framework_s)
        kind = CheckpointKind(kind_s)
    except ValueError:
        raise _bad(
            directory,
            f"has framework {framework_s!r} / kind {kind_s!r}; known: {[str(f) for f in Framework]} / "
            f"{[str(k) for k in CheckpointKind]}",
        ) from None
    step = _field(raw, "step", int, directory, "")
    files: dict[str, FileEntry] = {}
    for rel, entry in _field(raw, "files", dict, directory, "").items():
        checked_relpath(rel, directory)
        if not isinstance(entry, dict):
            raise _bad(directory, f"has a non-object entry for file {rel!r}")
        n = _field(entry, "bytes", int, directory, f"for file {rel!r}")
        sha = _field(entry, "sha256", str, directory, f"for file {rel!r}")
        if n < 0 or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise _bad(directory, f"has an invalid size/sha256 for file {rel!r}: {n}, {sha!r:.80}")
        files[rel] = FileEntry(bytes=n, sha256=sha)
    tensors: dict[str, TensorEntry] = {}
    for fqn, entry in _field(raw, "tensors", dict, directory, "").items():
        if not isinstance(entry, dict):
            raise _bad(directory, f"has a non-object entry for tensor {fqn!r}")
        shape = _field(entry, "shape", list, directory, f"for tensor {fqn!r}")
        dtype = _field(entry, "dtype", str, directory, f"for tensor {fqn!r}")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise _bad(directory, f"has an invalid shape for tensor {fqn!r}: {shape!r:.80}")
        tensors[fqn] = TensorEntry(shape=tuple(shape), dtype=dtype)
    extra = _field(raw, "extra", dict, directory, "")
    recorded = _field(raw, SELF_CHECKSUM, str, directory, "")
    if recorded != _self_checksum(raw):
        raise CheckpointError(
            f"checkpoint {directory}: {MANIFEST_NAME} was changed after it was written (its content does "
            f"not match the sha256 it records); the checkpoint is damaged: use another checkpoint"
        )
    return Manifest(framework=framework, kind=kind, step=step, files=files, tensors=tensors, extra=extra)


def check_files_present(directory: str, manifest: Manifest) -> None:
    """Raise ``CheckpointError`` naming the first file the manifest lists that is missing or of
    another size than written (no hashing: a stat per file)."""
    for rel, want in sorted(manifest.files.items()):
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"checkpoint {directory}: file {rel!r} is missing (the manifest lists it with "
                f"{want.bytes} bytes); the checkpoint is damaged: use another checkpoint"
            )
        size = os.path.getsize(path)
        if size != want.bytes:
            what = "truncated" if size < want.bytes else "longer than written"
            raise CheckpointError(
                f"checkpoint {directory}: file {rel!r} is {what}: {size} bytes, the manifest says "
                f"{want.bytes}; the checkpoint is damaged: use another checkpoint"
            )


def verify_checkpoint(directory: str, *, check_hashes: bool = True) -> Manifest:
    """Check that ``directory`` is a complete checkpoint: its manifest parses and every listed
    file exists with the listed size and (under ``check_hashes``) sha256.  Raises
    ``CheckpointError`` naming the first file that is missing, truncated (size differs) or
    corrupted (checksum differs), or the manifest problem."""
    manifest = read_manifest(directory)
    check_files_present(directory, manifest)
    if check_hashes:
        check_checksums(directory, manifest)
    return manifest


def check_checksums(directory: str, manifest: Manifest, *, share: tuple[int, int] = (0, 1)) -> None:
    """Raise ``CheckpointError`` naming the first file of ``directory`` whose sha256 is not the
    manifest's.  ``share=(i, n)`` reads only every ``n``-th file by name from the ``i``-th: ``n``
    ranks passing their ``(rank, world size)`` check every checksum once between them, each
    reading 1/n of the bytes."""
    index, count = share
    if not 0 <= index < count:
        raise ValueError(f"share must be (index, count) with 0 <= index < count, got {share!r}")
    for rel, want in sorted(manifest.files.items())[index::count]:
        got = file_entry(os.path.join(directory, rel))
        if got.sha256 != want.sha256:
            raise CheckpointError(
                f"checkpoint {directory}: file {rel!r} is corrupted: its sha256 is {got.sha256[:16]}..., "
                f"the manifest says {want.sha256[:16]}...; the checkpoint is damaged: use another checkpoint"
            )


def check_tensor(manifest: Manifest, fqn: str, shape: Sequence[int], dtype: str, *, where: str = "") -> None:
    """Raise ``CheckpointError`` naming ``fqn`` unless the manifest holds it with this global
    ``shape`` and ``dtype``."""
    at = f" {where}" if where else ""
    entry = manifest.tensors.get(fqn)
    if entry is None:
        near = sorted(manifest.tensors)[:6]
        raise CheckpointError(
            f"checkpoint{at} (step {manifest.step}) has no tensor {fqn!r}; it holds {len(manifest.tensors)} "
            f"tensors, e.g. {near}"
        )
    if tuple(entry.shape) != tuple(shape) or entry.dtype != dtype:
        raise CheckpointError(
            f"checkpoint{at} (step {manifest.step}): tensor {fqn!r} is {entry.dtype} of global shape "
            f"{tuple(entry.shape)}, but it is loaded into {dtype} of global shape {tuple(shape)}"
        )


def check_tensors(
    manifest: Manifest,
    expected: Mapping[str, tuple[Sequence[int], str]],
    *,
    strict: bool = True,
    where: str = "",
) -> None:
    """``check_tensor`` for every ``fqn -> (shape, dtype)`` in ``expected`` (in sorted order, so
    every rank names the same first offender); missing tensors are skipped unless ``strict``."""
    for fqn in sorted(expected):
        if not strict and fqn not in manifest.tensors:
            continue
        shape, dtype = expected[fqn]
        check_tensor(manifest, fqn, shape, dtype, where=where)


# ---------------------------------------------------------------------------------------------
# the checkpoint root


def step_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or step >= 10**STEP_DIGITS:
        raise ValueError(f"checkpoint step must be an int in [0, {10**STEP_DIGITS}), got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def new_nonce() -> str:
    """A random suffix for a staging directory (rank 0 draws it and shares it with the others)."""
    return secrets.token_hex(6)


def staging_dir(root: str, step: int, nonce: str | None = None) -> str:
    """Create (if needed) and return ``<root>/.staging-step-<N>-<nonce>``.  Every rank of one save
    passes the same ``nonce``; without one a fresh one is drawn."""
    name = step_name(step)
    nonce = new_nonce() if nonce is None else nonce
    if not re.fullmatch(r"[0-9A-Za-z]+", nonce):
        raise ValueError(f"staging nonce must be alphanumeric, got {nonce!r}")
    path = os.path.join(root, f".staging-{name}-{nonce}")
    os.makedirs(path, exist_ok=True)
    return path


def commit(staging: str, root: str, step: int) -> str:
    """Rename a finished staging directory (its manifest written, for this ``step``) to
    ``<root>/step-<N>`` and fsync the root; returns the final path.  A complete checkpoint of the
    same step already there is replaced (moved aside first, removed after)."""
    manifest = read_manifest(staging)
    if manifest.step != step:
        raise CheckpointError(f"commit of {staging}: its manifest is for step {manifest.step}, not {step}")
    final = os.path.join(root, step_name(step))
    trash = None
    if os.path.exists(final):
        trash = os.path.join(root, f"{_TRASH_PREFIX}{step:0{STEP_DIGITS}d}-{new_nonce()}")
        os.rename(final, trash)
    os.rename(staging, final)
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


@dataclass(frozen=True)
class SkippedStep:
    """A ``step-<N>`` entry of a checkpoint root that is not a complete checkpoint, and why."""

    step: int
    path: str
    reason: str


def _reason(error: CheckpointError, path: str) -> str:
    """The short cause of ``error``: without the ``checkpoint <path>: `` prefix and the advice."""
    return str(error).removeprefix(f"checkpoint {path}: ").split("; ")[0]


def _complete(path: str, step: int) -> str | None:
    """``None`` when ``path`` is a complete checkpoint of ``step`` (its manifest verifies, names
    the step, and every file it lists is present with its size), else why not."""
    if not os.path.isdir(path):
        return "it is not a directory"
    if not os.listdir(path):
        return "the directory is empty (its save did not start writing, or its files were removed)"
    try:
        manifest = read_manifest(path)
        if manifest.step != step:
            return f"its {MANIFEST_NAME} is for step {manifest.step}"
        check_files_present(path, manifest)
    except CheckpointError as e:
        return _reason(e, path)
    except OSError as e:
        return f"it cannot be read: {e}"
    return None


def scan_checkpoints(root: str) -> tuple[list[tuple[int, str]], list[SkippedStep]]:
    """``(complete, skipped)`` under ``root``: ``(step, path)`` of every complete checkpoint (see
    ``complete_checkpoints``), oldest first, and every ``step-<N>`` entry that is not one, with
    the reason (no or invalid manifest, a listed file missing or of another size, empty)."""
    if not os.path.isdir(root):
        return [], []
    found: dict[int, str] = {}
    aside: dict[int, str] = {}
    skipped: list[SkippedStep] = []
    for name in sorted(os.listdir(root)):
        m = _STEP_RE.match(name) or _TRASH_RE.match(name)
        if m is None:
            continue
        path = os.path.join(root, name)
        step = int(m.group(1))
        why = _complete(path, step)
        if why is None:
            (found if name.startswith("step-") else aside)[step] = path
        elif name.startswith("step-"):
            skipped.append(SkippedStep(step, path, why))
    for step, path in aside.items():
        found.setdefault(step, path)
    return sorted(found.items()), skipped


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step-<N>`` directory under ``root`` whose manifest verifies
    (its own checksum), names step ``N`` and lists only files that are present with their sizes,
    oldest first (file contents are not hashed here: ``verify_checkpoint``).

    A re-save of an existing step moves the old checkpoint aside before renaming the new one in; a
    crash between the two renames leaves only the moved-aside copy, which still counts as step
    ``N`` (it is complete, and the new one never was)."""
    return scan_checkpoints(root)[0]


def newest_complete(root: str) -> tuple[int, str] | None:
    """The newest complete checkpoint under ``root``, or ``None``."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _remove_step(root: str, path: str) -> None:
    """Delete a checkpoint directory so that no moment of it looks complete: first rename it out of
    the names that count (``step-<N>``, ``.trash-step-<N>``) and make the rename durable, then
    delete its files.  A kill during the deletion leaves a ``.pruned-step-*`` directory, which the
    next prune removes."""
    name = os.path.basename(path)
    m = _STEP_RE.match(name) or _TRASH_RE.match(name)
    step = m.group(1) if m is not None else "x"
    doomed = os.path.join(root, f"{_PRUNED_PREFIX}{step}-{new_nonce()}")
    os.rename(path, doomed)
    fsync_dir(root)
    crash_point(FaultPoint.PRUNING, 0, int(step) if step.isdigit() else -1)
    shutil.rmtree(doomed)


def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints, and every staging, moved-aside or
    half-pruned directory (left by saves that crashed); returns the removed paths.  Directories
    named like a checkpoint but incomplete are left for the user to inspect.  Call it only when
    no save into ``root`` is in progress."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"prune: keep must be an int >= 1 (the newest checkpoint is never removed), got {keep!r}")
    removed = []
    complete = complete_checkpoints(root)
    for _, path in complete[:-keep]:
        _remove_step(root, path)
        removed.append(path)
    kept = {path for _, path in complete[-keep:]}
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.startswith((_STAGING_PREFIX, _TRASH_PREFIX, _PRUNED_PREFIX)) and path not in kept:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


def checkpoint_entries(root: str) -> list[str]:
    """Paths of everything under ``root`` that a save or prune made: ``step-<N>`` directories
    (complete or not) and staging, moved-aside and half-pruned directories, sorted."""
    if not os.path.isdir(root):
        return []
    prefixes = (_STAGING_PREFIX, _TRASH_PREFIX, _PRUNED_PREFIX)
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if _STEP_RE.match(n) or n.startswith(prefixes)]


def clear_checkpoints(root: str) -> list[str]:
    """Delete every checkpoint under ``root`` (``checkpoint_entries``; other files stay), each
    renamed aside before its files go; returns the removed paths."""
    removed = []
    for path in checkpoint_entries(root):
        if os.path.isdir(path) and _STEP_RE.match(os.path.basename(path)):
            _remove_step(root, path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


_OS_ADVICE = {
    errno.ENOSPC: "the disk is full: free space, or pass a checkpoint directory on another disk",
    errno.EDQUOT: "the disk quota is used up: free space, or pass a checkpoint directory on another disk",
    errno.EROFS: "the file system is read-only: pass a writable checkpoint directory",
    errno.EACCES: "permission denied: pass a checkpoint directory you can write",
    errno.EPERM: "permission denied: pass a checkpoint directory you can write",
    errno.ENOTDIR: "a part of the path is a file, not a directory: pass a directory",
    errno.EEXIST: "a file of that name is in the way, not a directory: pass a directory",
    errno.EISDIR: "a directory is where a file should go: pass another path",
}


def describe_os_error(error: OSError, what: str) -> str:
    """One line for a failed file operation: ``what`` failed, the file, the cause and what to do
    (for a full or read-only disk, a missing permission, a file in the way of a directory)."""
    where = f"{error.filename}: " if error.filename is not None else ""
    cause = error.strerror or str(error)
    advice = _OS_ADVICE.get(error.errno or -1)
    return f"{what}: {where}{cause}" + (f"; {advice}" if advice else "")


__all__ = [
    "FORMAT", "MANIFEST_NAME", "VERSION", "CheckpointError", "CheckpointKind", "FileEntry", "Framework",
    "Manifest", "SkippedStep", "TensorEntry", "check_files_present", "check_tensor", "check_tensors",
    "checked_relpath", "checkpoint_entries", "clear_checkpoints", "commit", "complete_checkpoints", "describe_os_error",
    "file_entries", "file_entry", "fsync_dir", "fsync_file", "new_nonce", "newest_complete", "prune",
    "read_manifest", "scan_checkpoints", "staging_dir", "step_name", "verify_checkpoint", "write_manifest",
]
