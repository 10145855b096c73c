"""Activation checkpointing of transformer blocks, and a count of the activation bytes a forward
keeps for backward.

A checkpointed block keeps only its inputs; backward runs its forward again
(``torch.utils.checkpoint``, non-reentrant) to get the activations its gradients need.  Apply it
after tensor and context parallelism and before ``fully_shard`` (the torchtitan order): the block's
own ``forward`` is replaced, so the module hooks that tensor parallelism put on its submodules run
inside the checkpoint and are recomputed (their collectives run again in backward, on every rank
in the same order), while the hooks ``fully_shard`` puts on the block itself stay outside it: its
pre-backward hook gathers the parameters before the recomputation needs them.  The module tree
and parameter names do not change, so checkpoints and state dicts are those of the plain model.

``SavedActivations`` counts, during a forward, the bytes of the distinct storages autograd saves
for backward (parameters excluded) plus the inputs each checkpointed block holds for its
recomputation: the activation memory a step keeps between forward and backward, counted rather
than timed or sampled.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hp_dtensor import DTensor
from hp_protocols import ActivationCheckpointConfig, ActivationCheckpointMode

if TYPE_CHECKING:
    from hp_models.job import TrainLayout

_MARK = "_hp_activation_checkpoint"


def checkpoint_model_blocks(model: nn.Module, layout: TrainLayout) -> list[int]:
    """The trainer's step between tensor/context parallelism and ``fully_shard``: checkpoint the
    decoder layers of ``model`` (a ``Qwen3_5ForCausalLM``, or a pipeline stage, whose layers keep
    their index in the whole model: a stage checkpoints the layers the whole model would) as the
    job's ``activation_checkpoint`` section says; returns the layer indices checkpointed."""
    body: Any = model.model
    layers: Any = body.layers
    if isinstance(layers, nn.ModuleDict):
        indices = [int(name) for name in layers]
        blocks = list(layers.values())
    else:
        blocks = list(layers)
        indices = list(range(len(blocks)))
    return apply_activation_checkpoint(blocks, layout.activation_checkpoint, indices)


def apply_activation_checkpoint(blocks: Sequence[nn.Module], config: ActivationCheckpointConfig,
                                indices: Sequence[int] | None = None) -> list[int]:
    """Checkpoint the blocks ``config`` selects (``blocks`` in model order; under ``selective``
    every k-th, counted from 1); returns the indices checkpointed.  ``indices``: each block's
    index in the whole model, when ``blocks`` are some of its blocks (default: 0, 1, ...).  A
    block checkpointed twice is refused (its forward would be recomputed twice)."""
    where = list(range(len(blocks))) if indices is None else list(indices)
    if len(where) != len(blocks):
        raise ValueError(f"{len(blocks)} blocks but {len(where)} indices")
    chosen = [i for i in where if config.checkpointed(i)]
    if config.mode is ActivationCheckpointMode.NONE:
        return chosen
    for i, block in zip(where, blocks):
        if not config.checkpointed(i):
            continue
        if getattr(block, _MARK, False):
            raise ValueError(f"block {i} ({type(block).__name__}) is already activation-checkpointed; apply it once")
        # a forward already replaced on this instance is wrapped, not lost
        inner = block.__dict__.get("forward")
        block.forward = functools.partial(_checkpointed_forward, block, inner)  # type: ignore[method-assign]
        object.__setattr__(block, _MARK, True)
    return chosen


def is_checkpointed(block: nn.Module) -> bool:
    return bool(getattr(block, _MARK, False))


def _checkpointed_forward(block: nn.Module, inner: Any, *args: Any, **kwargs: Any) -> Any:
    """The block's forward under ``torch.utils.checkpoint`` (only when a backward can follow)."""
    run = inner if inner is not None else functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled():
        return run(*args, **kwargs)
    for counter in _counters:
        counter.hold((args, kwargs))
    return checkpoint(run, *args, use_reentrant=False, **kwargs)


_counters: list[SavedActivations] = []


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = ...forward...`` then ``saved.bytes``: the
    bytes of the distinct tensor storages kept for backward by the forward run inside (the
    parameters' and buffers' storages excluded; DTensors counted by their local shard)."""

    def __init__(self, model: nn.Module) -> None:
        self._exclude = {_storage_key(_local(t)) for t in [*model.parameters(), *model.buffers()]}
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # storage -> a tensor on it (kept alive)
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._kept.values())

    def hold(self, tree: Any) -> None:
        """Count the tensors of ``tree`` as kept for backward."""
        leaves, _ = torch.utils._pytree.tree_flatten(tree)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)

    def _add(self, t: torch.Tensor) -> None:
        local = _local(t)
        if local.layout is not torch.strided or local.device.type == "meta":
            return
        key = _storage_key(local)
        if key not in self._exclude:
            self._kept.setdefault(key, local)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t)
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        _counters.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        _counters.remove(self)
        self._hooks.__exit__(kind, error, tb)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


__all__ = ["SavedActivations", "apply_activation_checkpoint", "checkpoint_model_blocks", "is_checkpointed"]
