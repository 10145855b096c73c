"""hp_models: ready models and their tensor-parallel plans (Qwen3.5)."""

__version__ = "0.1.1"
