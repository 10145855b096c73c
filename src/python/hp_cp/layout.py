"""Where each token lives under context parallelism, written on integers only.

Causal attention costs more for late tokens than early ones, so the sequence is cut into
``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2*cp - 1 - r``: every rank then
does the same attention work.  A rank's tokens are a few contiguous *segments* of the global
sequence; the ring's skip rule works on segments (a key segment entirely after a query
segment is masked out and never computed).  Documents packed into one sequence (EOD data) are
described by their cumulative end positions, ``actual_seq_len``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Segment:
    """Global positions ``start .. start + length - 1``."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


class BlockKind(Enum):
    SKIP = "skip"  # every key is after every query: fully masked
    FULL = "full"  # every key is at or before every query: no causal mask needed
    CAUSAL = "causal"  # the diagonal: mask by positions


def check_seq_len(seq_len: int, cp: int) -> None:
    if cp > 1 and seq_len % (2 * cp) != 0:
        raise ValueError(
            f"sequence length {seq_len} cannot be split for context_parallel {cp}: the load-balanced causal "
            f"split needs 2*cp = {2 * cp} equal chunks, so the length must be a multiple of {2 * cp} "
            f"(pad to {-(-seq_len // (2 * cp)) * 2 * cp})"
        )


def chunk_ids(rank: int, cp: int) -> tuple[int, ...]:
    """The chunks of the ``2 * cp`` that ``rank`` holds, in the order it stores them."""
    if cp == 1:
        return (0,)
    return (rank, 2 * cp - 1 - rank)


def rank_segments(rank: int, cp: int, seq_len: int) -> tuple[Segment, ...]:
    check_seq_len(seq_len, cp)
    n = 1 if cp == 1 else 2 * cp
    size = seq_len // n
    return tuple(Segment(c * size, size) for c in chunk_ids(rank, cp))


def positions(segments: Sequence[Segment]) -> list[int]:
    return [p for s in segments for p in range(s.start, s.end)]


def classify(query: Segment, key: Segment) -> BlockKind:
    if key.start > query.end - 1:
        return BlockKind.SKIP
    if key.end - 1 <= query.start:
        return BlockKind.FULL
    return BlockKind.CAUSAL


@dataclass(frozen=True)
class RingPlan:
    """One ring of ``len(peers)`` participants: ``peers`` their global ranks in ring order,
    ``segments[j]`` the global token segments participant ``j`` holds (in storage order);
    ``index`` this rank's place.  Step ``i`` computes on the keys of participant
    ``(index - i) % n``; keys move to ``index + 1`` and arrive from ``index - 1``."""

    index: int
    peers: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...]

    @property
    def size(self) -> int:
        return len(self.peers)

    def source(self, step: int) -> int:
        return (self.index - step) % self.size

    @property
    def next_rank(self) -> int:
        return self.peers[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.peers[(self.index - 1) % self.size]

    def blocks(self, step: int) -> list[tuple[int, int, int, int, int, int, BlockKind]]:
        """The (query offset, query length, key offset, key length, query segment index, key
        segment index, kind) blocks step ``step`` computes, skipped blocks left out."""
        out: list[tuple[int, int, int, int, int, int, BlockKind]] = []
        qo = 0
        for qi, q in enumerate(self.segments[self.index]):
            ko = 0
            for ki, k in enumerate(self.segments[self.source(step)]):
                kind = classify(q, k)
                if kind is not BlockKind.SKIP:
                    out.append((qo, q.length, ko, k.length, qi, ki, kind))
                ko += k.length
            qo += q.length
        return out


def ring_plan(index: int, peers: Sequence[int], holder_segments: Sequence[Sequence[Segment]]) -> RingPlan:
    return RingPlan(index, tuple(peers), tuple(tuple(s) for s in holder_segments))


def check_actual_seq_len(actual_seq_len: Sequence[int], seq_len: int) -> None:
    prev = 0
    for e in actual_seq_len:
        if e <= prev:
            raise ValueError(
                f"actual_seq_len must be strictly increasing document end positions starting above 0, got "
                f"{list(actual_seq_len)}"
            )
        prev = e
    if prev != seq_len:
        raise ValueError(
            f"actual_seq_len must end at the sequence length {seq_len} (the last document ends there), got "
            f"{list(actual_seq_len)}"
        )


def document_ids(actual_seq_len: Sequence[int], seq_len: int) -> list[int]:
    """The document index of every position."""
    check_actual_seq_len(actual_seq_len, seq_len)
    return [bisect.bisect_right(actual_seq_len, p) for p in range(seq_len)]


def document_position_ids(actual_seq_len: Sequence[int], seq_len: int) -> list[int]:
    """Positions restarting at 0 at every document start."""
    check_actual_seq_len(actual_seq_len, seq_len)
    starts = [0, *actual_seq_len[:-1]]
    return [p - starts[bisect.bisect_right(actual_seq_len, p)] for p in range(seq_len)]


def actual_seq_len_from_eod(tokens: Sequence[int], eod_token: int) -> list[int]:
    """Documents end after each EOD token (and at the sequence end)."""
    ends = [i + 1 for i, t in enumerate(tokens) if t == eod_token]
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    return ends
