# mypy: disable-error-code="no-untyped-def,attr-defined,union-attr"
"""The trainer's step on the tiny Qwen3.5 at tp=2 (2 gloo ranks, sequence + loss parallel): the
norms' gradients that TP leaves ``Partial`` are summed in one all-reduce after the backward, so
the gradient norm issues one all-reduce and AdamW none -- against 15 and 42 when each ``Partial``
gradient is redistributed at every use -- and the gradients and the updated parameters equal
that per-use path bit for bit (the norm to float32 rounding)."""

from __future__ import annotations

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=60)
SEQ = 33  # uneven over 2 ranks


def _step(rank, world, bucketed):
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_fsdp import get_total_norm
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp, tiny_config
    from hp_models.trainer.partial_grads import replicate_partial_grads
    from hp_tp import loss_parallel

    torch.manual_seed(0)
    cfg = tiny_config()
    model = cfg.build()
    model.init_weights()
    parallelize_qwen3_5_tp(model, init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, SEQ))
    tgt = torch.randint(0, cfg.vocab_size, (4, SEQ))
    with loss_parallel():
        F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()
    partial = sum(any(pl.is_partial() for pl in p.grad.placements) for p in model.parameters())
    counts = {}
    with CommDebugMode() as comm:
        buckets = replicate_partial_grads(model.parameters()) if bucketed else 0
    counts["bucket"] = comm.get_total_counts()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    with CommDebugMode() as comm:
        norm = get_total_norm([p.grad.to(torch.float64) for p in model.parameters()])
    counts["norm"] = comm.get_total_counts()
    with CommDebugMode() as comm:
        opt.step()
    counts["adamw"] = comm.get_total_counts()
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"partial": partial, "buckets": buckets, "counts": counts, "grads": grads, "norm": norm.full_tensor()
            if hasattr(norm, "full_tensor") else norm, "params": params}


def test_partial_gradients_are_summed_once_with_the_same_numbers(pool2: RankPool) -> None:
    import torch

    per_use = pool2.run(_step, False)
    bucketed = pool2.run(_step, True)
    for old, new in zip(per_use, bucketed, strict=True):
        assert old["partial"] == new["partial"] == 14  # the norms' weights under sequence parallelism
        assert new["buckets"] == 1 and new["counts"] == {"bucket": 1, "norm": 1, "adamw": 0}
        assert old["counts"] == {"bucket": 0, "norm": 15, "adamw": 42}
        # (per use, the norm summed each gradient's float64 copy over the ranks; now the float32
        # sum the optimizer uses is squared: equal to float32 rounding)
        assert torch.allclose(old["norm"], new["norm"], rtol=1e-6, atol=0), (old["norm"], new["norm"])
        for name in old["grads"]:
            assert torch.equal(old["grads"][name], new["grads"][name]), name
            assert torch.equal(old["params"][name], new["params"][name]), name
    print(f"\ntp=2 step: {bucketed[0]['partial']} Partial gradients; collectives after the backward "
          f"{sum(per_use[0]['counts'].values())} -> {sum(bucketed[0]['counts'].values())}")
