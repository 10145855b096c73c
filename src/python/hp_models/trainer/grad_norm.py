"""The gradients' global norm, over every parameter of the whole model across every mesh dim,
and clipping by it (``max_grad_norm``).

``hp_fsdp.get_total_norm`` reduces each DTensor gradient's partial norms over the mesh dims it is
sharded on (FSDP's data-parallel shards, TP's shards; replicated dims counted once), so every
rank of a pipeline stage holds the norm of that stage's parameters.  Under pipeline parallelism
the stages hold different parameters: their squared norms are summed over the ``pp`` ranks.
Every rank then scales its gradients by ``min(max_grad_norm / (norm + 1e-6), 1)``, as
``torch.nn.utils.clip_grad_norm_`` does on one process, and reports the same norm.

The norm is taken of the gradients cast to float64 (a group of parameters at a time, so the
copies stay small): torch's float32 norm of one large gradient is off by up to ~2e-5 relative
(the tiny model's ``lm_head``), more than the shards of another layout differ, so a float32
norm would differ between layouts by its own rounding, not by the gradients.
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
        squares = torch.zeros((), dtype=torch.float64)
        for group in _groups(params):
            part = get_total_norm([p.grad.to(torch.float64) for p in group])
            squares += part.to(torch.float64) ** 2
        if self._pp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(squares, group=self._pp_group)
        total = squares.sqrt()
        if max_norm is not None:
            clip_grads_with_norm_(params, max_norm, total.to(torch.float32))
        return float(total.item())


_GROUP_ELEMENTS = 1 << 24  # parameters' elements per float64 copy (128 MiB of the whole tensors at most)


def _groups(params: list[Any]) -> list[list[Any]]:
    """``params`` in order, in groups of up to ``_GROUP_ELEMENTS`` elements (a larger parameter
    alone).  Sized by the whole parameters' element counts, the same on every rank of a stage, so
    every rank runs the same norm collectives."""
    groups: list[list[Any]] = []
    size = 0
    for p in params:
        n = p.numel()
        if not groups or size + n > _GROUP_ELEMENTS:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += n
    return groups
