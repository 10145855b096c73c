"""hp_models: ready models and plans (see issue 6)."""
