"""Tensor parallelism's torch primitives: the cross-entropy interception and local layer kernels."""

from hp_tp.platform.torch import local_layers
from hp_tp.platform.torch.loss_parallel import loss_parallel

__all__ = ["local_layers", "loss_parallel"]
