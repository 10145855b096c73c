"""The protocols' framework code: one folder per framework, found by ``package_backend``.

Each ``platform/<framework>/`` exports ``save_safetensors`` / ``load_safetensors`` (whole tensors,
DTensors gathered), which ``BaseStateDictAdapter`` uses for HF checkpoint folders; module
primitives come from the DTensor's platform layer.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from hp_dtensor.platform import package_backend


class ProtocolsBackend(Protocol):
    def save_safetensors(self, tensors: dict[str, Any], path: str, metadata: dict[str, str] | None = None) -> None: ...
    def load_safetensors(self, path: str) -> dict[str, Any]: ...


def current() -> ProtocolsBackend:
    return cast(ProtocolsBackend, package_backend("hp_protocols", "HF safetensors files"))
