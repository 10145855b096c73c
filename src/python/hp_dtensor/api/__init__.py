"""The DTensor API written once for every framework: the methods of a DTensor (``to_local``,
``from_local``, ``redistribute``, ``full_tensor``), ``from_local``'s cross-rank check,
``distribute_module``, and the RNG tracker that makes random ops draw what one process draws."""

from hp_dtensor.api.distribute_module import distribute_module

__all__ = ["distribute_module"]
