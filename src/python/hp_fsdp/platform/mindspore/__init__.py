"""``fully_shard``'s MindSpore primitives (PyNative): a differentiable gather per group whose
backward is the group's reduce_scatter; gradient-norm clipping out of place (``clip_grads``)."""

from hp_fsdp.platform.mindspore.fsdp import FSDP
from hp_fsdp.platform.mindspore.grad_norm import GRAD_NORM

__all__ = ["FSDP", "GRAD_NORM"]
