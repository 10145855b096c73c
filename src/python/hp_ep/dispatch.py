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


# What each rank tells every other before any row moves: (number of counts passed, rows of x,
# sum of the counts, negative counts), then the counts for the receiver's experts.  The message
# has the same size on every rank whatever a caller passed, so a bad caller cannot desynchronise
# the exchange, and every rank of the ep group sees every rank's header and refuses together.
COUNT_HEADER = 4


def count_message(counts: list[int], rows: int, num_experts: int, ep: int) -> list[int]:
    """The ``ep * (COUNT_HEADER + num_experts // ep)`` ints this rank sends in the count
    exchange (block ``r`` to ep rank ``r``); counts of the wrong length are sent as zeros."""
    local = num_experts // ep
    header = [len(counts), rows, sum(counts), sum(1 for c in counts if c < 0)]
    valid = len(counts) == num_experts
    return [
        v for r in range(ep)
        for v in header + (counts[r * local:(r + 1) * local] if valid else [0] * local)
    ]


def read_count_messages(received: list[int], num_experts: int, ep: int) -> tuple[int, ...]:
    """The counts each ep rank sends to this rank's experts (``DispatchPlan.recv_counts``), from
    the exchanged messages; ``ValueError`` -- the same on every rank of the ep group -- naming each
    rank whose counts do not describe its tokens (one count per expert, none negative, summing to
    its rows)."""
    local = num_experts // ep
    size = COUNT_HEADER + local
    problems: list[str] = []
    recv: list[int] = []
    for s in range(ep):
        n, rows, total, negative = received[s * size:s * size + COUNT_HEADER]
        if n != num_experts:
            problems.append(f"ep rank {s} passed token counts for {n} experts, the module stacks {num_experts}")
        elif negative:
            problems.append(f"ep rank {s} passed {negative} negative token count(s)")
        elif total != rows:
            problems.append(f"ep rank {s} passed token counts summing to {total} for {rows} token rows")
        recv.extend(received[s * size + COUNT_HEADER:(s + 1) * size])
    if problems:
        raise ValueError(
            "ExpertParallel: " + "; ".join(problems) + ". Every rank of the ep group stops here; pass one "
            "non-negative count per expert, summing to the rows of x grouped by expert"
        )
    return tuple(recv)
