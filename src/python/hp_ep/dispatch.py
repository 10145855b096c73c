"""Token dispatch plans for expert parallelism: framework-neutral, computed from token counts.

Experts are numbered globally and split into ``ep`` contiguous ranges of ``local_experts``; the
rank at coordinate ``r`` on the ``ep`` mesh dim holds experts ``[r * local, (r + 1) * local)``.
A rank's routed token copies arrive grouped by global expert.  Dispatch sends each rank the rows
of its experts (one all-to-all with variable split sizes, after the counts themselves were
exchanged so every receiver knows its split sizes), then regroups what arrived -- ordered by
(source rank, local expert) -- by local expert, so each expert sees one contiguous block.  Combine
is the exact reverse.  No row is dropped (no capacity factor): results equal one process.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchPlan:
    """One dispatch on one rank.  ``send_counts[g]``: rows this rank routes to global expert ``g``;
    ``recv_counts[s * local_experts + e]``: rows rank ``s`` sends to this rank's local expert ``e``."""

    ep: int
    local_experts: int
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]

    @property
    def send_splits(self) -> tuple[int, ...]:
        """Rows sent to each ep rank (the dispatch all-to-all's input split sizes)."""
        n = self.local_experts
        return tuple(sum(self.send_counts[r * n : (r + 1) * n]) for r in range(self.ep))

    @property
    def recv_splits(self) -> tuple[int, ...]:
        """Rows received from each ep rank (the dispatch all-to-all's output split sizes)."""
        n = self.local_experts
        return tuple(sum(self.recv_counts[s * n : (s + 1) * n]) for s in range(self.ep))

    @property
    def local_counts(self) -> tuple[int, ...]:
        """Rows each local expert runs, summed over the source ranks."""
        n = self.local_experts
        return tuple(sum(self.recv_counts[s * n + e] for s in range(self.ep)) for e in range(n))

    def group_order(self) -> list[int]:
        """Received row index for each grouped row: rows grouped by local expert, then source rank."""
        n = self.local_experts
        starts: list[int] = []
        at = 0
        for c in self.recv_counts:
            starts.append(at)
            at += c
        return [
            starts[s * n + e] + i
            for e in range(n) for s in range(self.ep) for i in range(self.recv_counts[s * n + e])
        ]


def inverse(order: list[int]) -> list[int]:
    """The permutation undoing ``order`` (``inverse(order)[order[i]] == i``)."""
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


def check_experts_divisible(num_experts: int, ep: int) -> int:
    """Experts per ep rank; ``ValueError`` naming both numbers when ``ep`` does not divide them."""
    if ep < 1 or num_experts % ep:
        raise ValueError(
            f"ExpertParallel: num_experts {num_experts} is not divisible by the ep mesh size {ep}; "
            f"pick an ep that divides the expert count"
        )
    return num_experts // ep
