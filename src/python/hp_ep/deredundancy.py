"""De-duplicating token dispatch plans (``alltoall_deredundancy``): framework-neutral, from counts.

The ep group's ranks form ``nodes`` nodes of ``node_size`` consecutive ranks; node ``d`` holds the
``node_experts = node_size * local_experts`` experts ``[d * node_experts, (d + 1) * node_experts)``.
The rank with local index ``i`` on its node exchanges with the ranks of local index ``i`` on every
node (the outer group, ordered by node) and with the ranks of its own node (the inner group).

Outer step: a rank sends each of its tokens once to every node holding at least one of the
token's experts -- the token's row, plus per routed copy its routing weight and one integer
``slot * node_experts + expert on that node`` (``slot``: the token's position in the block sent
to that node).  Inner step: the receiver expands the tokens it got into their copies and moves
them to the expert ranks of its node exactly like the plain all-to-all (``DispatchPlan`` over the
node).  Combine reverses both: the receiver scales each copy's output by its weight and sums the
copies of a token, so one row per token and node travels back, and the sender sums the nodes'
rows of each token.  Plain all-to-all moves one row per copy across nodes; this moves one per
(token, node) pair, fewer whenever a token routes to several experts on one node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hp_ep.dispatch import DispatchPlan


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSend:
    """What one rank sends to the nodes.  ``tokens``: token index of each row sent, the block for
    node 0 first, each block in token order; ``unique[d]`` / ``copies[d]``: rows (tokens) and
    routed copies for node ``d``; ``meta``: one integer per copy, in the copies' given order."""

    tokens: tuple[int, ...]
    unique: tuple[int, ...]
    copies: tuple[int, ...]
    meta: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class NodeReceive:
    """What one rank does with the tokens its outer group sent it.  Received copies are numbered
    in arrival order (source node, then the source's copy order); ``copy_order`` lists them
    sorted by expert on this node (stable), ``rows[j]`` is the received token row of copy
    ``copy_order[j]`` and ``send_counts[e]`` the copies for expert ``e`` of this node."""

    copy_order: tuple[int, ...]
    rows: tuple[int, ...]
    send_counts: tuple[int, ...]


def plan_node_send(
    counts: Sequence[int], token_index: Sequence[int], nodes: int, node_experts: int
) -> NodeSend:
    """``counts[g]``: copies routed to global expert ``g``; ``token_index[c]``: the token of copy
    ``c``, copies grouped by expert (so by node).  ``ValueError`` when the two disagree."""
    if len(counts) != nodes * node_experts:
        raise ValueError(
            f"alltoall_deredundancy: got token counts for {len(counts)} experts, the ep group holds "
            f"{nodes * node_experts} ({nodes} nodes x {node_experts} experts)"
        )
    if any(c < 0 for c in counts) or sum(counts) != len(token_index):
        raise ValueError(
            f"alltoall_deredundancy: expert counts sum to {sum(counts)} but {len(token_index)} token copies were "
            f"given; counts must be non-negative and count every copy"
        )
    tokens: list[int] = []
    unique: list[int] = []
    copies: list[int] = []
    meta: list[int] = []
    at = 0
    for d in range(nodes):
        n_copies = sum(counts[d * node_experts:(d + 1) * node_experts])
        block = token_index[at:at + n_copies]
        slot = {t: s for s, t in enumerate(sorted(set(block)))}
        expert_of = [e for e in range(node_experts) for _ in range(counts[d * node_experts + e])]
        meta.extend(slot[t] * node_experts + e for t, e in zip(block, expert_of))
        tokens.extend(sorted(slot))
        unique.append(len(slot))
        copies.append(n_copies)
        at += n_copies
    return NodeSend(tuple(tokens), tuple(unique), tuple(copies), tuple(meta))


def plan_node_receive(
    recv_unique: Sequence[int], recv_copies: Sequence[int], meta: Sequence[int], node_experts: int
) -> NodeReceive:
    """From the rows and copies each source node sent and the copies' integers.  ``ValueError``
    when an integer names a row or expert outside what arrived."""
    if len(meta) != sum(recv_copies):
        raise ValueError(
            f"alltoall_deredundancy: {len(meta)} copy descriptors arrived for {sum(recv_copies)} announced copies"
        )
    row_of: list[int] = []
    expert_of: list[int] = []
    base = at = 0
    for n_rows, n_copies in zip(recv_unique, recv_copies):
        for m in meta[at:at + n_copies]:
            slot, e = divmod(m, node_experts)
            if not 0 <= slot < n_rows:
                raise ValueError(
                    f"alltoall_deredundancy: a copy names token row {slot} of a block of {n_rows} rows; "
                    f"the ranks disagree on the dispatch"
                )
            row_of.append(base + slot)
            expert_of.append(e)
        base += n_rows
        at += n_copies
    order = sorted(range(len(expert_of)), key=expert_of.__getitem__)
    counts = [0] * node_experts
    for e in expert_of:
        counts[e] += 1
    return NodeReceive(tuple(order), tuple(row_of[c] for c in order), tuple(counts))


@dataclasses.dataclass(frozen=True, slots=True)
class DeredundancyPlan:
    """One de-duplicating dispatch on one rank (node ``node`` of ``nodes``).  ``send_counts[g]``:
    copies this rank routes to global expert ``g``; ``send_unique`` / ``send_copies``: token rows
    and copies it sends to each node, ``recv_unique`` / ``recv_copies`` what each node's rank of
    the same local index sent it; ``inner``: the all-to-all inside the node."""

    nodes: int
    node: int
    node_size: int
    local_experts: int
    send_counts: tuple[int, ...]
    send_unique: tuple[int, ...]
    send_copies: tuple[int, ...]
    recv_unique: tuple[int, ...]
    recv_copies: tuple[int, ...]
    inner: DispatchPlan

    @property
    def local_counts(self) -> tuple[int, ...]:
        """Rows each local expert runs."""
        return self.inner.local_counts

    @property
    def cross_node_rows(self) -> int:
        """Token rows this rank sends to other nodes (and receives back in the combine)."""
        return sum(u for d, u in enumerate(self.send_unique) if d != self.node)

    @property
    def cross_node_copies(self) -> int:
        """Routed copies this rank sends to other nodes (each one weight and one integer)."""
        return sum(c for d, c in enumerate(self.send_copies) if d != self.node)
