"""The gradients' global norm, over every parameter of the whole model across every mesh dim,
and clipping by it (``max_grad_norm``).

``hp_fsdp.get_total_norm`` reduces each DTensor gradient's partial norms over the mesh dims it is
sharded on (FSDP's data-parallel shards, TP's shards; replicated dims counted once), so every
rank of a pipeline stage holds the norm of that stage's parameters.  Under pipeline parallelism
the stages hold different parameters: their squared norms are summed over the ``pp`` ranks.
Every rank then scales its gradients by ``min(max_grad_norm / (norm + 1e-6), 1)``, as
``torch.nn.utils.clip_grad_norm_`` does on one process, and reports the same norm.
"""

from __future__ import annotations

from typing import Any

from hp_models.job import TrainLayout


class GradNorm:
    """The global gradient norm of the model on this rank (see the module's docstring)."""

    def __init__(self, layout: TrainLayout, *, distributed: bool) -> None:
        self._pp_group: Any = None
        if distributed and layout.pp > 1:
            dense, _ = layout.dims.build_mesh("cpu")  # (the groups exist already: no collective)
            self._pp_group = dense["pp"].get_group()

    def __call__(self, model: Any, max_norm: float | None) -> float:
        """The norm of the gradients ``model``'s parameters hold (the same on every rank); with
        ``max_norm`` they are clipped to it in place."""
        import torch

        from hp_fsdp import clip_grads_with_norm_, get_total_norm

        params = [p for p in model.parameters() if p.grad is not None]
        total = get_total_norm([p.grad for p in params])
        if self._pp_group is not None:
            import torch.distributed as dist

            squares = total.detach().to(torch.float64) ** 2
            dist.all_reduce(squares, group=self._pp_group)
            total = squares.sqrt().to(total.dtype)
        if max_norm is not None:
            clip_grads_with_norm_(params, max_norm, total)
        return float(total.item())
