"""Who writes which tensor of a sharded export, into which file: pure planning, no framework.

An export of a model too large for one rank assigns every output tensor to one writer rank.
Writers are balanced by bytes with the longest-processing-time rule (largest tensor first, to
the least loaded rank; ties to the lower rank), which keeps every rank's share within
``total / world + largest tensor``.  Each writer's tensors go to its own file(s), cut at
``max_shard_bytes`` if given, so a writer holds at most one file's tensors at a time.  Files are
numbered over all ranks in rank order (``model-00001-of-00004.safetensors``, the Hugging Face
naming), and ``weight_map`` says where each tensor is: the content of
``model.safetensors.index.json``.  Every rank computes the same plan from the same sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ShardFile:
    """One output file: its name, the rank that writes it, and its tensors in write order."""

    name: str
    rank: int
    tensors: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ExportPlan:
    """The files of an export (in global order), and each tensor's writer and byte size."""

    files: tuple[ShardFile, ...]
    writer: Mapping[str, int]
    sizes: Mapping[str, int]
    world: int
    assigned: tuple[int, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    @property
    def largest(self) -> int:
        return max(self.sizes.values(), default=0)

    @property
    def weight_map(self) -> dict[str, str]:
        return {t: f.name for f in self.files for t in f.tensors}

    def index_json(self) -> dict[str, Any]:
        """The ``model.safetensors.index.json`` content (tensors sorted by name, as HF writes it)."""
        wm = self.weight_map
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": {k: wm[k] for k in sorted(wm)}}


def assign_by_bytes(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Writer rank of each tensor, balanced by bytes (largest first to the least loaded rank)."""
    if world < 1:
        raise ValueError(f"assign_by_bytes: world must be >= 1, got {world}")
    bad = {k: v for k, v in sizes.items() if v < 0}
    if bad:
        raise ValueError(f"assign_by_bytes: negative byte sizes {bad}")
    load = [0] * world
    out: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[key] = rank
        load[rank] += sizes[key]
    return out


def plan_export(
    sizes: Mapping[str, int],
    world: int,
    *,
    max_shard_bytes: int | None = None,
    prefix: str = "model",
    order: list[str] | None = None,
) -> ExportPlan:
    """The export plan for tensors of ``sizes`` bytes over ``world`` ranks.  ``order`` (default:
    sorted names) is the order tensors take inside each writer's files."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"plan_export: max_shard_bytes must be positive, got {max_shard_bytes}")
    if not sizes:
        raise ValueError("plan_export: nothing to export (no tensors)")
    names = list(order) if order is not None else sorted(sizes)
    if sorted(names) != sorted(sizes):
        raise ValueError("plan_export: order must list every tensor exactly once")
    writer = assign_by_bytes(sizes, world)
    groups: list[tuple[int, list[str], int]] = []
    for rank in range(world):
        current: list[str] = []
        nbytes = 0
        for name in names:
            if writer[name] != rank:
                continue
            if current and max_shard_bytes is not None and nbytes + sizes[name] > max_shard_bytes:
                groups.append((rank, current, nbytes))
                current, nbytes = [], 0
            current.append(name)
            nbytes += sizes[name]
        if current:
            groups.append((rank, current, nbytes))
    n = len(groups)
    files = tuple(
        ShardFile(name=f"{prefix}-{k + 1:05d}-of-{n:05d}.safetensors", rank=rank, tensors=tuple(ts), nbytes=nb)
        for k, (rank, ts, nb) in enumerate(groups)
    )
    assigned = tuple(sum(f.nbytes for f in files if f.rank == r) for r in range(world))
    return ExportPlan(files=files, writer=writer, sizes=dict(sizes), world=world, assigned=assigned)
