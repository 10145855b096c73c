"""One optimizer step's forwards and backwards on MindSpore: the mean loss over the global batch
and this rank's gradients (plain local shards, reduced over the data-parallel ranks by
``fully_shard``, summed over the accumulation micro-steps).

MindSpore parameters hold no ``.grad``: ``mindspore.value_and_grad`` over the parameters the
optimizer holds (FSDP's sharded ones) returns their gradients.  With gradient sync off (every
micro-step but the last) ``fully_shard`` keeps the unsharded gradients and returns zeros, then
reduces them all with the last micro-step's backward, so the sum over micro-steps is the step's
gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hp_models.job import TrainLayout


def _plain(t: Any) -> Any:
    from mindspore import Tensor

    from hp_dtensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    return t if type(t) is Tensor else Tensor._make_subclass(Tensor, t)


class StepRunner:
    """The forward-and-backward of ``model`` over ``params``, the loss scaled as ``layout`` says."""

    def __init__(self, model: Any, params: list[Any], layout: TrainLayout, vocab: int, *, distributed: bool) -> None:
        import mindspore as ms
        from mindspore import ops

        self.model, self.layout, self.distributed = model, layout, distributed
        scale = layout.loss_scale()

        from hp_dtensor import DTensor
        from hp_tp import loss_parallel

        def loss_fn(ids: Any, tgt: Any) -> Any:
            logits = model(ids)
            if isinstance(logits, DTensor):  # a TP model's logits, split over the vocab
                with loss_parallel():
                    loss = _plain(ops.cross_entropy(logits.reshape(-1, vocab), tgt.reshape(-1)))
            else:
                loss = ops.cross_entropy(logits.reshape(-1, vocab), tgt.reshape(-1))
            return loss * scale if scale != 1.0 else loss

        self._grad_fn = ms.value_and_grad(loss_fn, None, params)
        self._scale = scale

    def __call__(self, dp_rank: int, ids: np.ndarray, tgt: np.ndarray) -> tuple[float, list[Any]]:
        """(the mean loss over the global batch ``ids``/``tgt``, this rank's gradients)."""
        from mindspore import Tensor

        layout = self.layout
        total = 0.0
        acc: list[Any] | None = None
        for micro in range(layout.accumulation):
            rows = layout.samples(dp_rank, micro)
            if layout.uses_fsdp:
                self.model.set_requires_gradient_sync(micro == layout.accumulation - 1)
            loss, grads = self._grad_fn(Tensor(ids[rows].astype(np.int32)), Tensor(tgt[rows].astype(np.int32)))
            total += float(loss.asnumpy()) / self._scale
            plain = [_plain(g) for g in grads]
            acc = plain if acc is None else [a + b for a, b in zip(acc, plain, strict=True)]
        assert acc is not None
        if layout.dp == 1 or not self.distributed:
            return total / layout.accumulation, acc
        # Each rank of a tensor-parallel group holds the same loss: the sum over all ranks is tp
        # times the sum over the data-parallel ranks.
        return sum_over_ranks(total) / (layout.world_size * layout.accumulation), acc


def _world_sum(values: np.ndarray) -> np.ndarray:
    """``values`` (float64) summed over every rank of the job, in float64 (mccl's all_reduce has
    no float64: the platform's collective composes it)."""
    from mindspore import Tensor

    from hp_dtensor.platform import current

    plat = current()
    world = plat.get_world_size()
    group = plat.get_or_create_group(tuple(range(world)))
    out = plat.COLLECTIVES.all_reduce(Tensor(values), "sum", group, world, plat.get_rank())
    return np.asarray(out.asnumpy(), np.float64)


def sum_over_ranks(value: float) -> float:
    """``value`` summed over every rank of the job."""
    return float(_world_sum(np.array([value], np.float64))[0])


def every_rank(value: float, rank: int, world: int) -> list[float]:
    """``value`` of every rank (rank order); one all_reduce (``Metrics``' peak memory)."""
    t = np.zeros(world, np.float64)
    t[rank] = value
    return [float(x) for x in _world_sum(t)]
