"""AdamW over the MindSpore parameters this rank holds: torch.optim.AdamW's update, in MindSpore ops.

MindSpore's ``nn.AdamWeightDecay`` computes another update (no bias correction, decay added to
the step), so the update is written out as torch's single-tensor AdamW does it, elementwise on
each parameter's local shard (an FSDP or TP shard steps exactly like its rows of the whole
tensor), in float32::

    p *= 1 - lr * weight_decay
    m += (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
"""

from __future__ import annotations

import math
from typing import Any

from hp_models.job import OptimSettings


def _local(t: Any) -> Any:
    """A plain Tensor sharing ``t``'s data (a DTensor parameter's local shard)."""
    from mindspore import Tensor

    return t if type(t) is Tensor else Tensor._make_subclass(Tensor, t)


class AdamW:
    """torch.optim.AdamW's math over ``params`` (MindSpore Parameters, plain or DTensor)."""

    def __init__(self, params: list[Any], optim: OptimSettings) -> None:
        self.params = params
        self.lr = optim.lr
        self.betas = optim.betas
        self.eps = optim.eps
        self.weight_decay = optim.weight_decay
        self.t = 0
        self.m: list[Any] = []
        self.v: list[Any] = []

    def step(self, grads: list[Any]) -> None:
        """One update with ``grads`` (plain local gradients, in the order of ``params``)."""
        import mindspore as ms
        from mindspore import ops

        if len(grads) != len(self.params):
            raise ValueError(f"AdamW.step got {len(grads)} gradients for {len(self.params)} parameters")
        self.init_state()
        self.t += 1
        b1, b2 = self.betas
        step_size = self.lr / (1 - b1**self.t)
        c2_sqrt = math.sqrt(1 - b2**self.t)
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            data = _local(p)
            if self.weight_decay:
                data = data * (1 - self.lr * self.weight_decay)
            m = self.m[i] + (g - self.m[i]) * (1 - b1)
            v = self.v[i] * b2 + g * g * (1 - b2)
            self.m[i], self.v[i] = m, v
            new = data - m / (ops.sqrt(v) / c2_sqrt + self.eps) * step_size
            ms.Parameter.set_data(p, new)  # the local shard (a DTensor keeps its layout)

    def init_state(self) -> None:
        """The moments as the first step starts them (zeros like each local shard), where missing:
        a checkpoint saves them, or loads into them."""
        from mindspore import ops

        if not self.m:
            self.m = [ops.zeros_like(_local(p)) for p in self.params]
            self.v = [ops.zeros_like(_local(p)) for p in self.params]

    def state_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.m + self.v)
