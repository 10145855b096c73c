"""safetensors files for torch tensors (DTensors are written whole)."""

from __future__ import annotations

from typing import Any


def save_safetensors(tensors: dict[str, Any], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path``; ``metadata`` defaults to ``{"format": "pt"}``, which
    transformers' ``from_pretrained`` requires."""
    from safetensors.torch import save_file

    from hp_dtensor.platform.torch.dtensor import DTensor

    plain = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().contiguous() for k, v in tensors.items()}
    save_file(plain, path, metadata=metadata if metadata is not None else {"format": "pt"})


def load_safetensors(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(path))
