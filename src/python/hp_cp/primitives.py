"""What context parallelism needs from a framework: ``CP`` of ``hp_cp.platform.<framework>``.

The framework computes attention blocks and moves tensors; which tokens a rank holds, which
blocks are skipped and who sends to whom is decided in ``hp_cp`` (``layout``).  Tensors are the
framework's own, typed ``Tensor`` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hp_cp.layout import RingPlan

Tensor = Any  # the framework's tensor type (torch.Tensor)
Group = Any  # the framework's process group


class CPPrimitives(Protocol):
    def take_chunks(self, t: Tensor, dim: int, n_chunks: int, chunks: Sequence[int]) -> Tensor:
        """Cut ``dim`` into ``n_chunks`` equal chunks and concatenate ``chunks`` in that order."""
        ...

    def shape_of(self, t: Tensor) -> tuple[int, ...]: ...

    def long_tensor(self, rows: Sequence[Sequence[int]], like: Tensor) -> Tensor:
        """An integer tensor of ``rows`` on ``like``'s device."""
        ...

    def ring_attention(
        self, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan, scale: float, doc_ids: Tensor | None,
        async_comm: bool, group: Group | None,
    ) -> Tensor:
        """q (B, H, S_local, D), k/v (B, Hkv, S_local, D) -> (B, H, S_local, D); differentiable.
        Causal by global position, restricted to one document where ``doc_ids`` (B, S_global)
        is given; ``plan.size - 1`` key/value exchanges forward, the same plus ``plan.size``
        gradient exchanges backward, all on ``group`` (None only when ``plan.size == 1``)."""
        ...

    def p2p_group(self, all_groups: Sequence[tuple[int, ...]], mine: tuple[int, ...]) -> Group:
        """A process group for point-to-point traffic over ``mine``, distinct from every other
        group: each of ``all_groups`` is created on every rank in the same order (collective),
        once per process."""
        ...

    def all_to_all(self, t: Tensor, split_dim: int, concat_dim: int, group: Group, n: int) -> Tensor:
        """Differentiable all-to-all (its backward is the reverse all-to-all)."""
        ...

    def all_gather(self, t: Tensor, group: Group, n: int) -> Tensor:
        """Every rank's ``t`` concatenated along dim 0 in rank order; differentiable (each rank
        gets the sum of the gradients of its rows)."""
        ...

    def reorder(self, t: Tensor, order: Sequence[int]) -> Tensor:
        """Rows of dim 0 taken in ``order``."""
        ...

    def repeat_heads(self, t: Tensor, times: int) -> Tensor:
        """Repeat every head of (B, H, S, D) ``times`` times, consecutively (differentiable)."""
        ...

    def sum_over(self, t: Tensor, group: Group, n: int) -> Tensor:
        """The sum over ``group``; gradient passes through unchanged (each rank's loss term)."""
        ...
