"""hp_protocols: module protocols and parallelism config (see issue 5)."""
