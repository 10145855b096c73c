"""``BaseStateDictAdapter``: convert between a model's state dict and a HF checkpoint layout."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from typing import Any

from hp_protocols.platform import current as _current


class BaseStateDictAdapter(ABC):
    """Subclasses define the key/layout mapping (``to_hf`` / ``from_hf``); loading and saving
    ``safetensors`` files is shared."""

    @abstractmethod
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """This model's state dict -> HF names and layouts."""

    @abstractmethod
    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """HF names and layouts -> this model's state dict."""

    def save_hf_state_dict(self, state_dict: dict[str, Any], path: str) -> None:
        """Write ``model.safetensors`` (full tensors) into the folder ``path``."""
        os.makedirs(path, exist_ok=True)
        _current().save_safetensors(self.to_hf(state_dict), os.path.join(path, "model.safetensors"))

    def load_hf_state_dict(self, path: str) -> dict[str, Any]:
        """Read every ``*.safetensors`` in ``path`` (honouring an index file) into this model's names."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {path!r}")
        hf: dict[str, Any] = {}
        for name in files:
            hf.update(_current().load_safetensors(os.path.join(path, name)))
        return self.from_hf(hf)
