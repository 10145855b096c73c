"""Export a (sharded) model state dict as Hugging Face safetensors shards, never whole on one rank.

Every output tensor gets one writer rank, balanced by bytes; the writer alone materializes it,
from the boxes the ranks hold (each moved once, between its holder and the writer only), one file
at a time, writes ``model-0000k-of-0000n.safetensors`` and drops it; once every rank has written
its files, rank 0 writes ``model.safetensors.index.json`` (and extra JSON files such as
``config.json``).  A rank therefore holds at most its assigned share plus one tensor's
conversion scratch, not the model.

The model-specific part is two things the caller passes: ``groups`` (each output name -> the
state-dict keys it is built from, in order) and ``convert`` (those keys' whole tensors -> the one
output tensor by name, e.g. concatenating q, k and v into a fused projection).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hp_checkpoint.export_plan import ExportPlan, plan_export
from hp_checkpoint.gather_to_rank import gather_to, plan_sources, transfer_primitives
from hp_checkpoint.safetensors_shards import shard_file_primitives

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportStats:
    """What one rank did: the plan (same on every rank), this rank's bytes assigned, the bytes of
    whole tensors it built in total and at most at once, and the files it wrote."""

    plan: ExportPlan
    rank: int
    assigned_bytes: int
    materialized_bytes: int
    peak_bytes: int
    files_written: tuple[str, ...]


def export_hf_safetensors(
    state_dict: Mapping[str, Any],
    path: str,
    *,
    groups: Mapping[str, Sequence[str]],
    convert: Callable[[dict[str, Any]], dict[str, Any]],
    max_shard_bytes: int | None = None,
    extra_json: Mapping[str, Any] | None = None,
) -> ExportStats:
    """Collective: every rank calls it with its own state dict (same keys, same ``groups``).  A
    failure on any rank (a conversion, a write) is raised on every rank as ``RuntimeError``."""
    prims = transfer_primitives()
    rank, world = prims.rank(), prims.world_size()
    missing = sorted({k for ks in groups.values() for k in ks} - set(state_dict))
    if missing:
        raise KeyError(f"export: the state dict has no {missing[:8]} (named by the output groups)")
    sizes: dict[str, int] = {}
    for name, keys in groups.items():
        if not keys:
            raise ValueError(f"export: output tensor {name!r} is built from no state-dict key")
        sizes[name] = sum(_nbytes(prims, state_dict[k]) for k in keys)
    plan = plan_export(sizes, world, max_shard_bytes=max_shard_bytes, order=list(groups))
    dst_of = {k: plan.writer[name] for name, keys in groups.items() for k in keys}
    sources = plan_sources({k: state_dict[k] for k in dst_of}, dst_of)

    error: str | None = None  # a rank's failure, raised on every rank; transfers go on so no peer waits
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            _remove_previous_export(path)
        except OSError as e:
            error = f"rank 0 could not prepare the folder: {type(e).__name__}: {e}"
    errors = [e for e in prims.all_gather_object(error) if e is not None]  # also the barrier before writing
    if errors:
        raise RuntimeError(f"HF export into {path!r} failed: {errors[0]}")

    live = peak = total = 0
    written: list[str] = []
    for shard in plan.files:
        mine = rank == shard.rank
        out: dict[str, Any] = {}
        for name in shard.tensors:
            parts = {k: gather_to(state_dict[k], sources[k], shard.rank) for k in groups[name]}
            if not mine or error is not None:
                continue
            try:
                made, value = _convert(prims, convert, name, parts, sizes[name])
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                error = f"rank {rank}, converting {name!r}: {type(e).__name__}: {e}"
                continue
            total += made
            peak = max(peak, live + made)
            out[name] = value
            live += sizes[name]
            del parts, value
        if mine and error is None:
            try:
                shard_file_primitives().write(out, os.path.join(path, shard.name))
                written.append(shard.name)
            except (OSError, ValueError, RuntimeError) as e:
                error = f"rank {rank} could not write {shard.name}: {type(e).__name__}: {e}"
            live = 0
        del out
    # every rank's outcome first: an index must not name the files of an export that failed
    errors = [e for e in prims.all_gather_object(error) if e is not None]
    if errors:
        raise RuntimeError(f"HF export into {path!r} failed: {errors[0]}")
    if rank == 0:
        try:
            _write_json(os.path.join(path, INDEX_NAME), plan.index_json())
            for fname, content in (extra_json or {}).items():
                _write_json(os.path.join(path, fname), content)
        except OSError as e:
            error = f"rank 0 could not write the index: {type(e).__name__}: {e}"
    errors = [e for e in prims.all_gather_object(error) if e is not None]  # also the barrier at the end
    if errors:
        raise RuntimeError(f"HF export into {path!r} failed: {errors[0]}")
    return ExportStats(plan=plan, rank=rank, assigned_bytes=plan.assigned[rank], materialized_bytes=total,
                       peak_bytes=peak, files_written=tuple(written))


def _convert(prims: Any, convert: Callable[[dict[str, Any]], dict[str, Any]], name: str, parts: dict[str, Any],
             nbytes: int) -> tuple[int, Any]:
    """(whole-tensor bytes built for it, the output tensor ``name``) from its parts."""
    scratch = sum(_nbytes(prims, v) for v in parts.values())
    converted = convert(parts)
    if set(converted) != {name}:
        raise ValueError(f"converting {list(parts)} gave {sorted(converted)}, expected only {name!r}")
    value = converted[name]
    if _nbytes(prims, value) != nbytes:
        raise ValueError(f"{name!r} has {_nbytes(prims, value)} bytes, its parts {nbytes}; a conversion must "
                         f"keep the bytes (the index records their sum)")
    new = all(value is not v for v in parts.values())  # a renamed tensor is not a new one
    return scratch + (_nbytes(prims, value) if new else 0), value


def _nbytes(prims: Any, t: Any) -> int:
    n = prims.itemsize(prims.dtype_name(t))
    for s in prims.shape_of(t):
        n *= s
    return int(n)


def _remove_previous_export(path: str) -> None:
    """Weights of an earlier export in the same folder would be read alongside the new ones."""
    for name in os.listdir(path):
        if name == INDEX_NAME or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(path, name))


def _write_json(file: str, content: Any) -> None:
    tmp = file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=2)
        f.write("\n")
    os.replace(tmp, file)
