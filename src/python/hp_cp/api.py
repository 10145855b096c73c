"""``ContextParallel``: split a batch along the sequence, run attention across the CP group,
reduce the loss over it.

The CP group is a ``DeviceMesh``: one dim for ``colossal`` (the ring) and ``ulysses`` (the
all-to-all group); two dims ``(ring, ulysses)`` for ``hybrid``, the ulysses groups innermost.
CP rank ``r`` (row-major over the mesh) holds chunks ``r`` and ``2*cp - 1 - r`` of the sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from hp_cp.config import ContextParallelConfig, CPMethod, MaskCompression
from hp_cp.layout import (
    RingPlan,
    Segment,
    check_actual_seq_len,
    check_seq_len,
    chunk_ids,
    document_ids,
    document_position_ids,
    positions,
    rank_segments,
    ring_plan,
)
from hp_cp.platform import framework_module
from hp_cp.primitives import CPPrimitives, Tensor
from hp_dtensor import DeviceMesh


def _ring_groups(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Every ring of the mesh ``mesh`` was sliced from (its dim 0 is the ring), in the same order
    on every rank: creating a process group is collective over all ranks."""
    root = mesh.get_root_mesh()
    if root is mesh or mesh.mesh_dim_names is None:
        return mesh.layout.groups_along(0)
    return root.layout.groups_along(root.layout.dim_index(mesh.mesh_dim_names[0]))


def _primitives() -> CPPrimitives:
    return cast(CPPrimitives, framework_module("context parallelism").CP)


class ContextParallel:
    """Context parallelism over ``mesh`` with ``config`` (validated here, on every rank, before
    any communication).  Constructing it is collective over every rank when the ring has more
    than one participant: it creates the ring's own process groups."""

    def __init__(self, mesh: DeviceMesh, config: ContextParallelConfig) -> None:
        config.validate()
        want = 2 if config.method is CPMethod.HYBRID else 1
        if mesh.ndim != want:
            raise ValueError(
                f"context_parallel_method {config.method.value} needs a {want}-D CP mesh"
                + (" (ring, ulysses)" if want == 2 else "") + f", got a {mesh.ndim}-D mesh of shape {mesh.shape}"
            )
        size = math.prod(mesh.shape)
        if size != config.degree:
            raise ValueError(f"the CP mesh has {size} ranks but context_parallel is {config.degree}")
        u = config.ulysses()
        if config.method is CPMethod.HYBRID and mesh.shape[1] != u:
            raise ValueError(
                f"the hybrid CP mesh's inner (ulysses) dim has {mesh.shape[1]} ranks but ulysses_degree_in_cp is {u}"
            )
        self.mesh = mesh
        self.config = config
        self.cp = config.degree
        self.ulysses = u
        coord = mesh.get_coordinate()
        assert coord is not None, "this rank is not part of the CP mesh"
        self.rank = coord[0] * mesh.shape[1] + coord[1] if mesh.ndim == 2 else coord[0]
        self._prims = _primitives()
        # The ring's point-to-point traffic runs on a process group of its own, never on the
        # default group or a mesh dim's group shared with other collectives, so its messages
        # cannot be taken for a pipeline stage's (or anyone's) on the same ranks.
        self._ring_group = None
        if config.degree // u > 1:
            self._ring_group = self._prims.p2p_group(_ring_groups(mesh), self.mesh.group_ranks(0))

    # ----- inputs -----
    def segments(self, seq_len: int) -> tuple[Segment, ...]:
        """The global token segments this rank holds after ``split``."""
        return rank_segments(self.rank, self.cp, seq_len)

    def positions(self, seq_len: int) -> list[int]:
        return positions(self.segments(seq_len))

    def split(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's share of ``t`` along ``dim`` (the sequence): chunks ``r`` and ``2cp-1-r``.
        ``ValueError`` with the sizes when the length is not a multiple of ``2 * cp``."""
        seq = self._prims.shape_of(t)[dim]
        check_seq_len(seq, self.cp)
        n = 1 if self.cp == 1 else 2 * self.cp
        return self._prims.take_chunks(t, dim, n, chunk_ids(self.rank, self.cp))

    def eod_position_ids(self, actual_seq_len: Sequence[Sequence[int]], seq_len: int, like: Tensor) -> Tensor:
        """This rank's ``position_ids`` (B, S_local), restarting at every document of each row."""
        rows = [document_position_ids(a, seq_len) for a in actual_seq_len]
        return self.split(self._prims.long_tensor(rows, like), dim=1)

    def gather_chunks(self, per_chunk: Tensor) -> Tensor:
        """Small per-chunk values of every rank in sequence order: ``per_chunk`` stacks one entry
        per chunk this rank holds (dim 0, storage order); returns (n_chunks, ...) with entry ``c``
        belonging to chunk ``c`` of the sequence.  One all-gather per CP mesh dim;
        differentiable.  Used for what crosses chunk boundaries (a convolution's halo, a
        recurrent state's transition)."""
        gathered = per_chunk
        # innermost dim first: on a (ring, ulysses) mesh the rows then come in row-major rank order
        for dim in reversed(range(self.mesh.ndim)):
            gathered = self._prims.all_gather(gathered, self.mesh.get_group(dim), self.mesh.shape[dim])
        per_rank = len(chunk_ids(0, self.cp))
        where = {c: r * per_rank + i for r in range(self.cp) for i, c in enumerate(chunk_ids(r, self.cp))}
        return self._prims.reorder(gathered, [where[c] for c in range(len(where))])

    def chunk_ids(self) -> tuple[int, ...]:
        """The sequence chunks this rank holds, in storage order."""
        return chunk_ids(self.rank, self.cp)

    # ----- attention -----
    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, seq_len: int,
        actual_seq_len: Sequence[Sequence[int]] | None = None, scale: float | None = None,
    ) -> Tensor:
        """Causal attention of this rank's queries over the whole sequence: q (B, H, S_local, D),
        k/v (B, Hkv, S_local, D), all split with ``split``; returns (B, H, S_local, D).
        ``actual_seq_len`` (one list of cumulative document ends per batch row, the compressed EOD
        mask) keeps attention inside documents; it is required when the config says EOD."""
        prims = self._prims
        b, h, s_local, d = prims.shape_of(q)
        hkv = prims.shape_of(k)[1]
        self.config.check_heads(h, hkv)
        check_seq_len(seq_len, self.cp)
        if s_local * self.cp != seq_len:
            raise ValueError(
                f"queries hold {s_local} tokens but seq_len {seq_len} over context_parallel {self.cp} gives "
                f"{seq_len // self.cp} per rank; pass tensors split with ContextParallel.split"
            )
        doc_ids = self._doc_ids(actual_seq_len, b, seq_len, q)
        scale = d ** -0.5 if scale is None else scale
        u = self.ulysses
        if u > 1:
            group = self.mesh.get_group(self.mesh.ndim - 1)
            if hkv % u != 0:  # too few key/value heads to split: replicate them up to the query heads
                k, v = prims.repeat_heads(k, h // hkv), prims.repeat_heads(v, h // hkv)
            q, k, v = (prims.all_to_all(x, 1, 2, group, u) for x in (q, k, v))
        out = prims.ring_attention(q, k, v, self._plan(seq_len), scale, doc_ids, self.config.async_comm,
                                   self._ring_group)
        if u > 1:
            out = prims.all_to_all(out, 2, 1, self.mesh.get_group(self.mesh.ndim - 1), u)
        return out

    def _doc_ids(self, actual_seq_len: Sequence[Sequence[int]] | None, batch: int, seq_len: int,
                 like: Tensor) -> Tensor | None:
        if actual_seq_len is None:
            if self.config.compression is MaskCompression.EOD:
                raise ValueError("the CP config uses the compressed EOD mask: pass actual_seq_len to attention")
            return None
        if len(actual_seq_len) != batch:
            raise ValueError(f"actual_seq_len has {len(actual_seq_len)} rows but the batch has {batch}")
        for row in actual_seq_len:
            check_actual_seq_len(row, seq_len)
        return self._prims.long_tensor([document_ids(a, seq_len) for a in actual_seq_len], like)

    def _plan(self, seq_len: int) -> RingPlan:
        """The ring this rank attends over: every CP rank (colossal), none (ulysses: after the
        all-to-all a rank holds the whole sequence), or the ranks with the same ulysses index
        (hybrid), each holding its ulysses group's segments."""
        u, cp = self.ulysses, self.cp
        groups = cp // u

        def held(group: int) -> list[Segment]:
            return [seg for m in range(group * u, (group + 1) * u) for seg in rank_segments(m, cp, seq_len)]

        my_group = self.rank // u
        if self.mesh.ndim == 2:
            peers = self.mesh.group_ranks(0)
        elif u == 1:
            peers = self.mesh.group_ranks(0)
        else:
            peers = (self.mesh.group_ranks(0)[self.rank],)
        return ring_plan(my_group if groups > 1 else 0, peers, [held(g) for g in range(groups)])

    # ----- loss and gradients -----
    def sum_over(self, t: Tensor) -> Tensor:
        """The sum of ``t`` over the CP group (one all-reduce per CP mesh dim); the gradient
        passes through unchanged.  Also what sums the gradients of parameters that are
        replicated over the CP ranks when nothing else (FSDP over ``dp_shard * cp``) does."""
        for dim in range(self.mesh.ndim):
            t = self._prims.sum_over(t, self.mesh.get_group(dim), self.mesh.shape[dim])
        return t

    def reduce_loss(self, loss_sum: Tensor, token_count: Tensor) -> Tensor:
        """The mean loss over the whole sequence from each rank's summed loss and counted
        (non-ignored) tokens: sum over CP ranks of both, then divide.  Ranks may count
        different numbers of tokens (ignored labels, document ends)."""
        return self.sum_over(loss_sum) / self.sum_over(token_count)
