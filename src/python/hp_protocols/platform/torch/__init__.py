"""The protocols' torch primitives: whole-tensor safetensors files."""

from hp_protocols.platform.torch.safetensors_io import load_safetensors, save_safetensors

__all__ = ["load_safetensors", "save_safetensors"]
