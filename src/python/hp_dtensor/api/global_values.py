"""The global answers of a DTensor whose object is its local shard (MindSpore's).

A torch DTensor is a wrapper with the global shape, so ``numel()``, ``len()`` and ``item()`` go
through its op dispatch.  A DTensor that *is* its local tensor would answer them from the shard,
differently on each rank; ``GlobalValueMethods`` answers from the spec and the full tensor
instead, the same on every rank (the Python conversions are collectives: call them on all ranks).
"""

from __future__ import annotations

from typing import Any

from hp_dtensor.api.dtensor_methods import DTensorMethods


class GlobalValueMethods(DTensorMethods):
    """Sizes and Python values of the global tensor, for a backend's local-shard DTensor class."""

    itemsize: Any  # the backend tensor's

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    def numel(self) -> int:
        n = 1
        for s in self._spec.shape:
            n *= s
        return n

    nelement = numel

    @property
    def size(self) -> int:
        return self.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * int(self.itemsize)

    def __len__(self) -> int:
        if not self._spec.shape:
            raise TypeError("len() of a 0-d DTensor")
        return self._spec.shape[0]

    def item(self) -> Any:
        """The one element of the global tensor, on every rank (a collective: call it on all ranks)."""
        return self.full_tensor().item()

    def tolist(self) -> Any:
        """The global tensor as nested lists, on every rank (a collective)."""
        return self.full_tensor().tolist()

    def __float__(self) -> float:
        return float(self.full_tensor())

    def __int__(self) -> int:
        return int(self.full_tensor())

    def __index__(self) -> int:
        return int(self.full_tensor())

    def __bool__(self) -> bool:
        return bool(self.full_tensor())
