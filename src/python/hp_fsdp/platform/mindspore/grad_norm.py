"""Gradient-norm clipping on MindSpore: not built.  MindSpore parameters carry no ``.grad`` (a
functional ``grad`` returns the gradients), so ``clip_grad_norm_(model.parameters(), ...)`` has
nothing to read; every use raises one ``NotImplementedError`` naming the feature, on every rank."""

from __future__ import annotations

from typing import Any, NoReturn

_MESSAGE = (
    "clip_grad_norm_ / clip_grads_with_norm_ / get_total_norm are not supported on the mindspore backend "
    "yet: MindSpore parameters hold no .grad (mindspore.value_and_grad returns the gradients)"
)


class _NotBuilt:
    """``GradNormPrimitives`` whose every member raises the one error above."""

    def __getattr__(self, name: str) -> NoReturn:
        raise NotImplementedError(_MESSAGE)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(_MESSAGE)


GRAD_NORM: Any = _NotBuilt()

__all__ = ["GRAD_NORM"]
