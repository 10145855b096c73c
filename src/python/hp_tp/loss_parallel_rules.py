"""Argument rules of vocab-parallel ``cross_entropy``, on shapes and placements only.

Both backends check a ``loss_parallel`` call here before any collective, so every rank raises the
same error (the arguments are the same on every rank) and no rank is left waiting.  The exception
types and messages follow ``torch.nn.functional.cross_entropy`` where it has one, so code that
catches torch's errors keeps working; layout errors name ``loss_parallel``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from hp_dtensor.placement_types import Placement, Replicate, Shard


class Reduction(enum.Enum):
    NONE = "none"
    MEAN = "mean"
    SUM = "sum"


class TargetKind(enum.Enum):
    CLASS_INDEX = "class_index"  # integer class per element, shape = input shape without the class dim
    PROBABILITY = "probability"  # floating class probabilities, same shape as the input


@dataclass(frozen=True)
class CrossEntropyCall:
    """A checked call: where the classes are and how the loss is reduced."""

    class_dim: int
    num_classes: int
    #: The mesh dim whose ranks hold the vocab slices (every other mesh dim replicates).
    vocab_mesh_dim: int
    target_kind: TargetKind
    reduction: Reduction
    label_smoothing: float


def parse_reduction(reduction: str) -> Reduction:
    try:
        return Reduction(reduction)
    except ValueError:
        raise ValueError(f"{reduction} is not a valid value for reduction") from None


def legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
    """torch's mapping of the deprecated ``size_average`` / ``reduce`` flags."""
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if not reduce:
        return "none"
    return "mean" if size_average else "sum"


def class_dim_of(ndim: int) -> int:
    """Classes are on dim 1 of ``(N, C, d1, ...)`` inputs and on dim 0 of an unbatched ``(C,)``."""
    return 0 if ndim == 1 else 1


def check_layout(input_shape: Sequence[int], placements: Sequence[Placement]) -> tuple[int, int]:
    """(class dim, the mesh dim holding the vocab) of DTensor logits, or the ``ValueError`` for a
    layout loss_parallel cannot compute.  It reads only the DTensor's spec, which every rank
    shares, so every rank raises alike here before any collective."""
    ndim = len(input_shape)
    if ndim == 0:
        raise ValueError("loss_parallel: cross_entropy needs logits with a class dim, got a 0-D tensor")
    cdim = class_dim_of(ndim)
    shard_dims = [k for k, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == cdim]
    others = [p for k, p in enumerate(placements) if k not in shard_dims]
    if len(shard_dims) != 1 or not all(isinstance(p, Replicate) for p in others):
        hint = ""
        last = [p for p in placements if isinstance(p, Shard) and p.dim % ndim == ndim - 1]
        if ndim >= 3 and last:
            hint = (
                "; cross_entropy reads classes from dim 1, so for (batch, seq, vocab) logits pass "
                "logits.flatten(0, -2) with target.flatten(), or logits.movedim(-1, 1)"
            )
        raise ValueError(
            f"loss_parallel: cross_entropy needs logits sharded on the class dim (dim {cdim} of shape "
            f"{tuple(input_shape)}) on one mesh dim and replicated on the others, got placements "
            f"{tuple(placements)}{hint}"
        )
    return cdim, shard_dims[0]


def check_cross_entropy(
    input_shape: Sequence[int],
    placements: Sequence[Placement],
    target_shape: Sequence[int],
    target_is_floating: bool,
    weight_shape: Sequence[int] | None,
    reduction: str,
    label_smoothing: float,
    *,
    target_is_bool: bool = False,
) -> CrossEntropyCall:
    """Check one call; raise the error torch raises (or a ``ValueError`` naming loss_parallel)."""
    red = parse_reduction(reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    cdim, vocab_mesh_dim = check_layout(input_shape, placements)
    num_classes = int(input_shape[cdim])
    batch = tuple(int(n) for i, n in enumerate(input_shape) if i != cdim)
    if target_is_bool:
        raise RuntimeError(
            "loss_parallel: cross_entropy expects class indices as an integer tensor or class "
            "probabilities as a floating one, got a bool target; pass target.long()"
        )
    if target_is_floating:
        kind = TargetKind.PROBABILITY
        if tuple(target_shape) == batch and tuple(target_shape) != tuple(input_shape):
            raise RuntimeError(
                f"loss_parallel: a floating target is read as class probabilities, which need the logits' "
                f"shape {tuple(input_shape)}, got {tuple(target_shape)}; pass class indices as an integer "
                f"tensor (target.long())"
            )
        if tuple(target_shape) != tuple(input_shape):
            raise RuntimeError(
                f"loss_parallel: class-probability targets must have the logits' shape {tuple(input_shape)}, "
                f"got {tuple(target_shape)}"
            )
    else:
        kind = TargetKind.CLASS_INDEX
        if tuple(target_shape) != batch:
            if len(input_shape) >= 2 and len(target_shape) >= 1 and len(target_shape) == len(batch) == 1:
                raise ValueError(
                    f"Expected input batch_size ({batch[0]}) to match target batch_size ({target_shape[0]})."
                )
            raise RuntimeError(
                f"loss_parallel: expected target of shape {list(batch)} for logits of shape "
                f"{list(input_shape)} (classes on dim {cdim}), got {list(target_shape)}"
            )
    if weight_shape is not None and tuple(weight_shape) != (num_classes,):
        raise RuntimeError(
            f"weight tensor should be defined either for all {num_classes} classes or no classes but got "
            f"weight tensor of shape: {list(weight_shape)}"
        )
    return CrossEntropyCall(cdim, num_classes, vocab_mesh_dim, kind, red, float(label_smoothing))


class OtherRanksFailed(RuntimeError):
    """Raised on the ranks whose own arguments passed when other vocab ranks' did not: the target,
    weight and reduction are plain per-rank values, and must be the same on every rank."""


def other_ranks_failed() -> OtherRanksFailed:
    return OtherRanksFailed(
        "loss_parallel: cross_entropy's arguments failed their checks on other ranks of the vocab mesh "
        "dim but not here (their error is raised there); pass the same target, weight, ignore_index, "
        "reduction and label_smoothing on every rank"
    )


def check_target_range(bad_target: int | None) -> None:
    """``bad_target``: one class index outside ``[0, C)`` that is not ``ignore_index``, or None."""
    if bad_target is not None:
        raise IndexError(f"Target {bad_target} is out of bounds.")
