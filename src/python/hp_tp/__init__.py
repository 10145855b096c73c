"""hp_tp: tensor-parallel styles (see issue 4)."""
