"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

Every rank writes only its own shards; a checkpoint saved under one layout (mesh, placements,
uneven splits) loads under any other, each rank reading exactly its slice.  Model and optimizer
state dicts are keyed by parameter name, so optimizer state reshards with its parameters::

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    save(sd, "ckpt/step-100")
    ...                                   # later, under any parallelism
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    load(sd, "ckpt/step-100")             # in place
    set_optimizer_state_dict(model, optim, sd["optim"])

The checkpoint is plain DCP: torch's ``dcp_to_torch_save`` and ``FileSystemReader`` read it.
Only the torch platform implements it so far.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from hp_checkpoint.manifest import FileEntry
from hp_checkpoint.platform import feature
from hp_dtensor.layout.shard_boxes import CheckpointError


class DCPPrimitives(Protocol):
    """What DCP checkpoints need from a framework (``DCP`` of ``hp_checkpoint.platform.<framework>``)."""

    def save(self, state_dict: dict[str, Any], checkpoint_id: Any) -> None: ...
    def load(self, state_dict: dict[str, Any], checkpoint_id: Any, *, strict: bool = True) -> None: ...
    def write(
        self, state_dict: dict[str, Any], directory: str, group: Any = None
    ) -> Mapping[str, FileEntry]: ...
    def tensor_meta(self, value: Any) -> tuple[tuple[int, ...], str] | None: ...
    def get_model_state_dict(self, model: Any) -> dict[str, Any]: ...
    def set_model_state_dict(self, model: Any, state_dict: dict[str, Any], *, strict: bool = True) -> None: ...
    def get_optimizer_state_dict(self, model: Any, optim: Any) -> dict[str, Any]: ...
    def set_optimizer_state_dict(self, model: Any, optim: Any, state_dict: dict[str, Any]) -> None: ...
    def stage_to_cpu(self, state_dict: Any) -> Any: ...
    # How the ranks of a save agree (rank 0's decisions, every rank's outcome).
    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any: ...
    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]: ...
    def new_world_group(self) -> Any:
        """A group of every rank for an asynchronous save's collectives (``None`` without one)."""
        ...


def dcp_backend() -> DCPPrimitives:
    """The framework's DCP primitives (torch only: ``NotImplementedError`` elsewhere)."""
    prims: DCPPrimitives = feature("DCP", "sharded checkpoints")
    return prims


def save(state_dict: dict[str, Any], checkpoint_id: Any) -> None:
    """Write ``state_dict`` (nested dicts of DTensors, tensors and Python values) as a DCP
    checkpoint; every rank calls it and writes its own shards, replicas once."""
    dcp_backend().save(state_dict, checkpoint_id)


def load(state_dict: dict[str, Any], checkpoint_id: Any, *, strict: bool = True) -> None:
    """Load a DCP checkpoint in place into ``state_dict``, resharding to its DTensors' layouts.
    A missing key (under ``strict``), a different global shape or dtype raises ``CheckpointError``
    on every rank, naming the tensor."""
    dcp_backend().load(state_dict, checkpoint_id, strict=strict)


def get_model_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict, parameters as the model holds them (DTensors, no copies)."""
    return dcp_backend().get_model_state_dict(model)


def set_model_state_dict(model: Any, state_dict: dict[str, Any], *, strict: bool = True) -> None:
    """Load ``state_dict`` into the model (entries loaded in place already are left alone)."""
    dcp_backend().set_model_state_dict(model, state_dict, strict=strict)


def get_optimizer_state_dict(model: Any, optim: Any) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (its tensors, no copies)."""
    return dcp_backend().get_optimizer_state_dict(model, optim)


def set_optimizer_state_dict(model: Any, optim: Any, state_dict: dict[str, Any]) -> None:
    """Load a name-keyed optimizer state dict into ``optim``."""
    dcp_backend().set_optimizer_state_dict(model, optim, state_dict)


__all__ = [
    "CheckpointError", "get_model_state_dict", "get_optimizer_state_dict", "load", "save",
    "set_model_state_dict", "set_optimizer_state_dict",
]
