"""``CP``: the torch primitives of ``hp_cp.primitives.CPPrimitives``."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_cp.layout import RingPlan
from hp_cp.platform.torch.ring import ring_attention
from hp_dtensor.platform import current
from hp_dtensor.platform.torch import collectives


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, t: torch.Tensor, split_dim: int, concat_dim: int, group: Any, n: int
    ) -> torch.Tensor:
        ctx.args = (split_dim, concat_dim, group, n)
        return collectives.all_to_all(t.contiguous(), split_dim, concat_dim, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        split_dim, concat_dim, group, n = ctx.args
        return collectives.all_to_all(grad.contiguous(), concat_dim, split_dim, group, n), None, None, None, None


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, n: int) -> torch.Tensor:  # type: ignore[override]
        return collectives.all_reduce(t.contiguous(), "sum", group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, n: int) -> torch.Tensor:  # type: ignore[override]
        ctx.args = (group, n)
        return collectives.all_gather(t.contiguous(), 0, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        group, n = ctx.args
        return collectives.reduce_scatter(grad.contiguous(), 0, "sum", group, n), None, None


class _RingGroups:
    """The ring's own process groups, by the full set of rings they were made with (making them is
    collective, so every rank keeps the same entries).  This rank's group is held weakly: c10d
    owns it, so ``destroy_process_group`` frees it and stops its threads (kept alive here, they
    would run into interpreter exit).  A new default group starts an empty cache."""

    def __init__(self) -> None:
        self.generation = -1  # the backend's world_generation() the entries belong to
        self.mine: dict[tuple[tuple[tuple[int, ...], ...], tuple[int, ...]], weakref.ref[Any]] = {}

    def get(self, all_groups: tuple[tuple[int, ...], ...], mine: tuple[int, ...]) -> Any:
        if not dist.is_initialized():
            raise RuntimeError("context parallelism needs a process group: call init_device_mesh "
                               "(or init_process_group) first")
        generation = current().world_generation()
        if generation != self.generation:
            self.generation, self.mine = generation, {}
        key = (all_groups, mine)
        if key not in self.mine:
            # every rank makes every ring, in the same order; ``mine`` holds this rank
            made = {g: dist.new_group(list(g)) for g in all_groups}
            self.mine[key] = weakref.ref(made[mine])
        group = self.mine[key]()
        if group is None:
            raise RuntimeError(
                f"the ring's process group over ranks {list(mine)} was destroyed while context "
                f"parallelism still uses it; destroy only the default group, then set up again"
            )
        return group


_RING_GROUPS = _RingGroups()


class TorchCP:
    def take_chunks(self, t: torch.Tensor, dim: int, n_chunks: int, chunks: Sequence[int]) -> torch.Tensor:
        parts = t.chunk(n_chunks, dim=dim) if n_chunks > 1 else (t,)
        return torch.cat([parts[c] for c in chunks], dim=dim) if len(chunks) > 1 else parts[chunks[0]]

    def shape_of(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape)

    def long_tensor(self, rows: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor([list(r) for r in rows], dtype=torch.long, device=like.device)

    def ring_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
        doc_ids: torch.Tensor | None, async_comm: bool, group: Any,
    ) -> torch.Tensor:
        return ring_attention(q, k, v, plan, scale, doc_ids, async_comm, group)

    def p2p_group(self, all_groups: Sequence[tuple[int, ...]], mine: tuple[int, ...]) -> Any:
        return _RING_GROUPS.get(tuple(tuple(g) for g in all_groups), tuple(mine))

    def all_to_all(self, t: torch.Tensor, split_dim: int, concat_dim: int, group: Any, n: int) -> torch.Tensor:
        if n == 1:
            return t
        return _AllToAll.apply(t, split_dim, concat_dim, group, n)  # type: ignore[no-any-return]

    def all_gather(self, t: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        if n == 1:
            return t
        return _AllGather.apply(t, group, n)  # type: ignore[no-any-return]

    def reorder(self, t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
        return t[torch.tensor(list(order), dtype=torch.long, device=t.device)]

    def repeat_heads(self, t: torch.Tensor, times: int) -> torch.Tensor:
        return t if times == 1 else t.repeat_interleave(times, dim=1)

    def sum_over(self, t: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        if n == 1:
            return t
        return _SumOver.apply(t, group, n)  # type: ignore[no-any-return]


CP = TorchCP()
