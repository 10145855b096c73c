"""Context parallelism's torch primitives: ring attention over point-to-point exchanges,
differentiable all-to-all and sums, token selection."""

from hp_cp.platform.torch.primitives import CP

__all__ = ["CP"]
