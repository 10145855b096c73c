# mypy: disable-error-code="no-untyped-def,attr-defined,arg-type"
"""Which process group each collective ran on, seen the same way for our fully_shard and torch's.

``GroupLog`` is a torch dispatch mode: every collective either library issues reaches torch as a
c10d op (``c10d._allgather_base_``, ``_c10d_functional.all_reduce``...) whose process group is
one of its arguments, so one observer attributes both implementations' collectives to the ranks
they ran over.  The tests map those ranks to a mesh dim name (``{(0, 2): "dp", (0, 1): "tp"}``) or
to a group size; the libraries' own ``CommDebugMode`` totals are checked against it, so nothing
is counted by one and missed by the other.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op (packet name) -> the kind both CommDebugModes call it
KINDS = {
    "c10d._allgather_base_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "c10d.allreduce_": "all_reduce",
    "_c10d_functional.all_reduce": "all_reduce",
    "c10d.alltoall_base_": "all_to_all",
    "_c10d_functional.all_to_all_single": "all_to_all",
}
# torch's CommDebugMode names (str of its keys) -> ours
TORCH_NAMES = {
    "c10d._allgather_base_": "all_gather", "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.allreduce_": "all_reduce", "c10d_functional.all_reduce": "all_reduce",
    "c10d_functional.all_gather_into_tensor": "all_gather",
    "c10d_functional.reduce_scatter_tensor": "reduce_scatter",
}


def _group_ranks(func: Any, args: tuple[Any, ...]) -> tuple[int, ...] | None:
    if func.namespace == "_c10d_functional":
        from torch.distributed.distributed_c10d import _resolve_process_group

        name = [a for a in args if isinstance(a, str)][-1]  # the group name is the last str argument
        return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
            except RuntimeError:  # another script object (a ReduceOp)
                continue
    return None


class GroupLog(TorchDispatchMode):
    """``log``: (kind, group ranks, bytes moved: the gathered output of an all_gather, the input
    of the others) of every collective, in issue order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kind = KINDS.get(str(func.overloadpacket))
        if kind is not None:
            ranks = _group_ranks(func, tuple(args))
            assert ranks is not None, func
            # c10d's reduce_scatter takes (output, input); every other op's first tensor is the
            # one counted, except functional all_gather's, which is the input of one rank
            first = args[1] if kind == "reduce_scatter" and func.namespace == "c10d" else args[0]
            t = first[0] if isinstance(first, list) else first
            nbytes = t.numel() * t.element_size()
            if kind == "all_gather" and func.namespace == "_c10d_functional":
                nbytes *= len(ranks)
            self.log.append((kind, ranks, nbytes))
        return func(*args, **(kwargs or {}))

    def counts(self, names: dict[tuple[int, ...], str] | None = None) -> dict[str, int]:
        """``kind@dim`` (``names`` maps a group's ranks to its mesh dim) or ``kind@<group size>``."""
        out: Counter[str] = Counter()
        for kind, ranks, _ in self.log:
            where = names[ranks] if names is not None else str(len(ranks))
            out[f"{kind}@{where}"] += 1
        return dict(out)

    def bytes(self, names: dict[tuple[int, ...], str] | None = None) -> dict[str, int]:
        out: Counter[str] = Counter()
        for kind, ranks, nbytes in self.log:
            where = names[ranks] if names is not None else str(len(ranks))
            out[f"{kind}@{where}"] += nbytes
        return dict(out)


def torch_counts(comm: Any) -> dict[str, int]:
    """torch's CommDebugMode counts under our kind names."""
    out: Counter[str] = Counter()
    for k, v in comm.get_comm_counts().items():
        out[TORCH_NAMES.get(str(k), str(k))] += v
    return dict(out)


def kinds_only(counts: dict[str, int]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for k, v in counts.items():
        out[k.split("@")[0]] += v
    return dict(out)


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| (0 for empty shards; a shape mismatch fails)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0
