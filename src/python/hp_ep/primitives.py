"""What expert parallelism needs from a framework: ``EP`` of ``hp_ep.platform.<framework>``.

The backend moves rows (count exchange, the variable-split all-to-all with its reverse as the
backward, row gathers); every decision -- which rows go where, in what order -- is made in
``hp_ep.dispatch``.  Tensors are the framework's own, typed ``Tensor`` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hp_ep.platform import framework_module

Tensor = Any  # the framework's tensor type


class EPPrimitives(Protocol):
    def to_list(self, t: Tensor) -> list[int]: ...
    def exchange_counts(self, counts: Tensor, group: Any, ep: int) -> Tensor:
        """All-to-all of equal slices of an int tensor: slice ``r`` goes to group rank ``r``."""
        ...
    def all_to_all_rows(self, x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any) -> Tensor:
        """Differentiable all-to-all of rows with variable split sizes; backward is the reverse."""
        ...
    def take_rows(self, x: Tensor, index: Sequence[int]) -> Tensor:
        """Rows ``x[index]``, differentiable (backward scatters back)."""
        ...
    def scale_rows(self, x: Tensor, weights: Tensor) -> Tensor:
        """Row ``i`` of ``x`` times ``weights[i]`` (a 1-D tensor), differentiable in both."""
        ...
    def sum_rows(self, x: Tensor, index: Sequence[int], like: Tensor) -> Tensor:
        """A zero tensor shaped and typed like ``like`` with row ``i`` of ``x`` added into row
        ``index[i]``, in order; differentiable in ``x`` (backward gathers)."""
        ...
    def int_tensor(self, values: Sequence[int], like: Tensor) -> Tensor: ...
    def local_of(self, t: Tensor) -> Tensor: ...


def ep_primitives() -> EPPrimitives:
    prims: EPPrimitives = framework_module("expert parallelism (ExpertParallel)").EP
    return prims
