"""Checked ``torch.distributed.checkpoint`` (DCP) save and load of state dicts holding DTensors.

The DTensor answers DCP's extension hooks itself (which box each rank writes and reads), so
``dcp.save`` writes each rank's own shard once and ``dcp.load`` reads this rank's slice of any
saved layout.  ``load`` adds what DCP's default planner leaves out: a dtype check (DCP would cast
silently), and one error naming the tensor raised on every rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from hp_checkpoint.file_seal import FileSeal
from hp_checkpoint.manifest import FileEntry, describe_os_error
from hp_checkpoint.platform.torch.dcp_reader import FastFileSystemReader
from hp_dtensor.layout.dtensor_spec import DTensorSpec
from hp_dtensor.layout.shard_boxes import CheckpointError, check_no_partial


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus: every tensor's global shape and dtype must match the
    checkpoint, and no target may be ``Partial``; errors name the tensor."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                if self.allow_partial_load:
                    continue
                near = sorted(saved)[:8]
                raise CheckpointError(
                    f"checkpoint has no entry {fqn!r} (it holds {len(saved)} entries, e.g. {near}); "
                    f"pass strict=False to load the entries it has"
                )
            if not isinstance(obj, torch.Tensor):
                continue
            if isinstance(md, BytesStorageMetadata):
                raise CheckpointError(
                    f"checkpoint entry {fqn!r} is a Python object, but the state dict expects a tensor "
                    f"of shape {tuple(obj.shape)}"
                )
            if tuple(md.size) != tuple(obj.shape) or md.properties.dtype != obj.dtype:
                raise CheckpointError(
                    f"checkpoint entry {fqn!r} is {md.properties.dtype} of global shape {tuple(md.size)}, "
                    f"but the state dict expects {obj.dtype} of global shape {tuple(obj.shape)}"
                )
            spec = getattr(obj, "_spec", None)  # a DTensor (this module cannot import dtensor: it imports us)
            if isinstance(spec, DTensorSpec):
                check_no_partial(fqn, spec.placements)
        return super().create_local_plan()


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Without a process group a save or load is a one-process one, as intended: DCP's warning
    that it assumes so is noise here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _reraise(exc: CheckpointException, what: str, checkpoint_id: Any, rank: int | None = None) -> CheckpointError:
    """DCP gathers every rank's failure and raises the same ``CheckpointException`` (a
    ``BaseException``) everywhere; turn it into one ``CheckpointError`` naming the first failure.
    ``rank``: the rank that ran a one-process DCP call (whose own numbering says 0)."""
    failures = exc.failures
    first = min(failures)
    err = failures[first]
    inner = err[0] if isinstance(err, tuple) else err
    where = f"on rank {rank}" if rank is not None else f"on ranks {sorted(failures)}"
    if isinstance(inner, OSError):  # a full or read-only disk: name the file and what to do
        return CheckpointError(describe_os_error(inner, f"{what} {checkpoint_id!s} failed {where}"))
    return CheckpointError(f"{what} {checkpoint_id!s} failed {where}: {inner}")


def save(state_dict: dict[str, Any], checkpoint_id: Any) -> None:
    """``dcp.save``: every rank writes its own shards of ``state_dict`` under ``checkpoint_id``."""
    try:
        dcp.save(state_dict, checkpoint_id=checkpoint_id)
    except CheckpointException as e:
        raise _reraise(e, "checkpoint save to", checkpoint_id) from None


def load(state_dict: dict[str, Any], checkpoint_id: Any, *, strict: bool = True) -> None:
    """``dcp.load`` in place into ``state_dict`` (each DTensor reads only its own slice, whatever
    layout saved it), after checking keys, global shapes and dtypes; raises ``CheckpointError``
    on every rank naming the first offending tensor.  ``strict=False`` skips keys the checkpoint
    lacks.

    Each rank plans and reads on its own: a load's global plan is every rank's local plan
    unchanged, so DCP's planning collectives would only pickle every read item to the coordinator
    and back.  One small gather of the outcomes afterwards raises a failure on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    failure: str | None = None
    try:
        with _one_process_is_intended():
            dcp.load(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_reader=FastFileSystemReader(checkpoint_id),
                planner=CheckedLoadPlanner(allow_partial_load=not strict),
                no_dist=True,
            )
    except CheckpointException as e:
        failure = str(_reraise(e, "checkpoint load from", checkpoint_id, rank))
    except CheckpointError as e:
        failure = str(e)
    if dist.is_initialized():
        failures: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise CheckpointError(failure)


class _SealingWriter(FileSystemWriter):
    """DCP's file writer (one file per rank) that leaves fsync to a ``FileSeal``: as soon as this
    rank's data files are written, a background thread fsyncs and checksums them while DCP's
    closing collectives wait for the other ranks; the coordinator's index (``.metadata``) is
    sealed the same way once written."""

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1)
        self.seals: list[FileSeal] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        written = sorted({result.storage_data.relative_path for result in fut.value()})
        self.seals.append(FileSeal(str(self.path), written))
        return fut

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.seals.append(FileSeal(str(self.path), [".metadata"]))

    def entries(self) -> dict[str, FileEntry]:
        """Every file this rank wrote, fsynced, with its size and sha256 (waits for the seals)."""
        out: dict[str, FileEntry] = {}
        for seal in self.seals:
            out.update(seal.result())
        return out


def _caching_planner(group: Any) -> DefaultSavePlanner:
    """DCP's save planner with plan caching: a rank whose local plan is the one of its last save
    (a trainer saving the same state dict every few steps) sends an empty plan, and the
    coordinator scatters only what changed, instead of pickling every item's metadata through
    the object collectives each save.  DCP keys its cache by planner class; the key here adds the
    group's ranks so that saves over different groups in one process never share a cache."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    ranks = "world" if group is None or not dist.is_initialized() else ",".join(
        str(r) for r in dist.get_process_group_ranks(group))
    planner._cached_plans_key = f"{type(planner).__name__}[{ranks}]"
    return planner


def write(state_dict: dict[str, Any], directory: str, group: Any = None) -> dict[str, FileEntry]:
    """``save`` into ``directory`` (DCP's collectives on ``group``, default the world); returns
    the files (paths relative to it) this rank wrote, each fsynced, with size and sha256, once
    every rank has finished (DCP's closing collective).  Raises ``OSError`` when a written file
    cannot be fsynced or read back."""
    writer = _SealingWriter(directory)
    try:
        with _one_process_is_intended():
            dcp.save(state_dict, storage_writer=writer, process_group=group, no_dist=not dist.is_initialized(),
                     planner=_caching_planner(group))
    except CheckpointException as e:
        for seal in writer.seals:  # no thread outlives a failed save
            with contextlib.suppress(OSError):
                seal.result()
        raise _reraise(e, "checkpoint save to", directory) from None
    return writer.entries()


def tensor_meta(value: Any) -> tuple[tuple[int, ...], str] | None:
    """Global shape and neutral dtype name (``float32``, ``bfloat16``, ...) of a tensor or
    DTensor; ``None`` for anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(value.shape), str(value.dtype).removeprefix("torch.")
