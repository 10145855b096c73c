"""Tensor parallelism's MindSpore primitives: the cross-entropy interception."""

from hp_tp.platform.mindspore.loss_parallel import loss_parallel

__all__ = ["loss_parallel"]
