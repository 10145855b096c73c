"""``fully_shard``'s torch primitives: flat buffers, freeable storage, backward hooks, norms."""

from hp_fsdp.platform.torch.fsdp import FSDP
from hp_fsdp.platform.torch.grad_norm import GRAD_NORM

__all__ = ["FSDP", "GRAD_NORM"]
