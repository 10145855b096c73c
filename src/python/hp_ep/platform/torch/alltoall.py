"""torch primitives for token dispatch: ``torch.distributed.all_to_all_single`` with split sizes.

Every collective is recorded with ``CommDebugMode`` as ``all_to_all`` with the bytes this rank
sends (its own rows included), so tests count dispatches exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.comm_debug import record


def _all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    record("all_to_all", x.numel() * x.element_size(), dist.get_world_size(group))
    dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class _TorchEP:
    def to_list(self, t: torch.Tensor) -> list[int]:
        return [int(v) for v in t.tolist()]

    def exchange_counts(self, counts: torch.Tensor, group: Any, ep: int) -> torch.Tensor:
        counts = counts.to(torch.int64).contiguous()
        out = torch.empty_like(counts)
        record("all_to_all", counts.numel() * counts.element_size(), ep)
        dist.all_to_all_single(out, counts, group=group)
        return out

    def all_to_all_rows(
        self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any
    ) -> torch.Tensor:
        out: torch.Tensor = _AllToAllRows.apply(x, list(out_splits), list(in_splits), group)
        return out

    def take_rows(self, x: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
        return x.index_select(0, torch.tensor(list(index), dtype=torch.int64, device=x.device))

    def scale_rows(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return x * weights.unsqueeze(-1)

    def sum_rows(self, x: torch.Tensor, index: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(list(index), dtype=torch.int64, device=x.device)
        return torch.zeros_like(like).index_add(0, idx, x.to(like.dtype))

    def int_tensor(self, values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=like.device)

    def local_of(self, t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t


EP = _TorchEP()
