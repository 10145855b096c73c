"""Pipeline parallelism's torch primitives (``hp_pp.platform.PPPrimitives``)."""

from hp_pp.platform.torch.primitives import PP

__all__ = ["PP"]
