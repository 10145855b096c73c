"""safetensors files for MindSpore tensors (DTensors are written whole), via safetensors' numpy API
so the files are the same bytes a torch run writes and either framework reads them."""

from __future__ import annotations

from typing import Any


def save_safetensors(tensors: dict[str, Any], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (DTensors as full tensors) to ``path`` with the header ``metadata``."""
    import numpy as np
    from mindspore import Tensor
    from safetensors.numpy import save_file

    from hp_dtensor.platform.mindspore.dtensor import DTensor

    plain = {}
    for k, v in tensors.items():
        whole = v.full_tensor() if isinstance(v, DTensor) else v
        plain[k] = np.require(Tensor.asnumpy(whole) if isinstance(whole, Tensor) else np.asarray(whole), requirements="C")
    save_file(plain, path, metadata=metadata)


def load_safetensors(path: str) -> dict[str, Any]:
    from mindspore import Tensor
    from safetensors.numpy import load_file

    return {k: Tensor(v) for k, v in load_file(path).items()}
