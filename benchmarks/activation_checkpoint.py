"""Activation checkpointing of the tiny Qwen3.5 on one process: what it saves and what it costs.

Printed per sequence length, for none, selective (every 3rd and every 2nd block) and full: the
bytes of activations one forward keeps for backward (distinct storages saved for backward, counted
with saved-tensor hooks, plus the inputs each checkpointed block holds; parameters excluded) and
their ratio to none, and the forward + backward time (median of repeated steps after a warm-up,
the modes interleaved so machine noise hits them alike) with its ratio to none.  The gradients are
checked bit-equal to none's.

Run: ./pants run benchmarks/activation_checkpoint.py   (or python benchmarks/activation_checkpoint.py)
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MODES = [("none", "2"), ("selective", "3"), ("selective", "2"), ("full", "2")]
SEQ_LENS = (64, 256)
BATCH = 2
REPEATS = 7
WARMUP = 1


def _model(mode: str, option: str) -> Any:
    import torch

    from hp_models.activation_checkpoint import apply_activation_checkpoint
    from hp_models.qwen3_5 import tiny_config
    from hp_models.qwen3_5.model import decoder_layers
    from hp_protocols import ActivationCheckpointConfig, ActivationCheckpointMode

    torch.manual_seed(0)
    model = tiny_config().build()
    model.init_weights()
    apply_activation_checkpoint(decoder_layers(model.model), ActivationCheckpointConfig(mode=ActivationCheckpointMode.parse(mode), selective_ac_option=option))
    return model


def _step(model: Any, ids: Any) -> tuple[int, Any]:
    import torch.nn.functional as F

    from hp_models.activation_checkpoint import SavedActivations

    model.zero_grad(set_to_none=True)
    with SavedActivations(model) as saved:
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    return saved.bytes, [p.grad for p in model.parameters()]


def main() -> None:
    import torch

    torch.set_num_threads(1)
    for seq in SEQ_LENS:
        ids = torch.randint(0, 1024, (BATCH, seq), generator=torch.Generator().manual_seed(1))
        models = [_model(*m) for m in MODES]
        results = [_step(m, ids) for m in models]
        base_bytes, base_grads = results[0]
        for (mode, _), (_, grads) in zip(MODES, results):
            assert all(torch.equal(a, b) for a, b in zip(grads, base_grads)), f"{mode}: gradients differ"
        times: list[list[float]] = [[] for _ in MODES]
        for rep in range(WARMUP + REPEATS):
            for i, m in enumerate(models):
                t0 = time.perf_counter()
                _step(m, ids)
                if rep >= WARMUP:
                    times[i].append(time.perf_counter() - t0)
        medians = [statistics.median(t) for t in times]
        print(f"tiny Qwen3.5 (4 layers), batch {BATCH} x {seq} tokens, 1 process, 1 thread:")
        for (mode, option), (nbytes, _), t in zip(MODES, results, medians):
            name = f"{mode} every {option}" if mode == "selective" else mode
            print(f"  {name:<19} saved {nbytes / 2**20:8.2f} MiB  ({nbytes / base_bytes:5.3f} of none)   "
                  f"fwd+bwd {t * 1e3:7.1f} ms  ({t / medians[0]:4.2f}x none)")
    print("gradients bit-equal to none in every mode")


if __name__ == "__main__":
    main()
