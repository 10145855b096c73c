"""``BaseModel``: the root protocol Module of a model."""

from __future__ import annotations

import dataclasses
from typing import Any

from hp_dtensor.platform import current as _current
from hp_protocols.module import Module, children_of

_plat = _current()


class BaseModel(Module):
    """A whole model: verifies the protocol over its tree, initializes weights, counts size."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def verify_module_protocol(self) -> None:
        """Raise ``TypeError`` naming every submodule that owns parameters but is not a protocol
        Module (it could not be configured or sharded by declaration)."""
        bad = [
            fqn or "<root>"
            for fqn, sub in _plat.named_modules(self)
            if not isinstance(sub, Module) and _plat.direct_params(sub) and not _allowed_leaf(sub)
        ]
        if bad:
            raise TypeError(
                f"{type(self).__name__}: submodules {bad} hold parameters but are not protocol Modules; "
                f"wrap them with Module.from_nn_module(...) or define them as Module subclasses"
            )

    def init_weights(self, *, buffer_device: Any = None) -> None:
        self.init_states(buffer_device=buffer_device)

    def update_from_config(self, trainer_config: Any) -> None:
        """Adjust the model from the trainer's config (e.g. vocab from the tokenizer); default none."""

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, int]:
        """(parameter count, training FLOPs per token ~ 6 x non-embedding parameters).

        Models with attention override this to add the sequence-length term."""
        nparams = sum(_plat.numel(p) for p in _plat.parameters(self))
        n_embed = sum(
            _plat.numel(p) for _, m in _plat.named_modules(self) if _plat.is_embedding_module(m)
            for p in _plat.parameters(m)
        )
        return nparams, 6 * (nparams - n_embed)


def _allowed_leaf(module: Any) -> bool:
    # Framework leaves with fixed semantics (Linear, Embedding, norms) are fine inside a protocol
    # Module: the parent declares their sharding by path.
    return _plat.is_linear_module(module) or _plat.is_embedding_module(module) or not children_of(module)
