"""Expert parallelism's torch primitives: count exchange, variable-split all-to-all, row gathers."""

from hp_ep.platform.torch.alltoall import EP

__all__ = ["EP"]
