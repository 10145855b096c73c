# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc"
"""Pipeline parallelism composed with tensor and data parallelism on 4 gloo ranks equals one process.

The dense mesh ``["pp", "dp_replicate", "fsdp", "tp"]`` at pp=2 x tp=2 (the Qwen3.5 TP plan
inside each stage, sequence-sharded activations between stages) and pp=2 x dp_shard=2
(``fully_shard`` inside each stage), pp=2 x dp_replicate=2 (HSDP), 1F1B and interleaved, tied and
untied embeddings: the loss,
every gradient of the first step and every parameter after 3 AdamW steps equal plain
single-process training on the whole batch (float64 weights, rtol 1.5e-4, atol 1e-5), compared
whole (``full_tensor``) on the rank holding each parameter.  Under FSDP each step issues one
reduce_scatter and one all_gather per FSDP unit, not one per microbatch (under HSDP one all_reduce
across replicas per unit).  PP x TP x FSDP needs 8
ranks: it is not run here.
"""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=300)

BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-2
RTOL, ATOL = 1.5e-4, 1e-5
_REFERENCES: dict[tuple[int, bool], Any] = {}  # per rank process: one reference per model


def _config(layers: int, tie: bool):
    from hp_models.qwen3_5 import tiny_config

    return tiny_config(num_hidden_layers=layers, tie_word_embeddings=tie, vocab_size=256, hidden_size=64,
                       intermediate_size=128)


def _loss(logits, target):
    import torch.nn.functional as F

    from hp_dtensor import DTensor
    from hp_tp import loss_parallel

    if isinstance(logits, DTensor):  # vocab-sharded logits under TP
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _build(cfg):
    import torch

    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    return model.to(torch.float64)


def _reference(layers: int, tie: bool):
    """One process, the whole batch: losses, first-step gradients and final parameters by name."""
    import torch

    from hp_models import synthetic

    key = (layers, tie)
    if key in _REFERENCES:
        return _REFERENCES[key]
    cfg = _config(layers, tie)
    model = _build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, grads = [], {}
    for step in range(STEPS):
        ids, tgt = synthetic.batch(0, step, BATCH, SEQ, cfg.vocab_size)
        opt.zero_grad()
        loss = _loss(model(ids), tgt)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    _REFERENCES[key] = (losses, grads, params)
    return _REFERENCES[key]


def _whole(t):
    from hp_dtensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _worst(got: dict, want: dict) -> float:
    """Largest |got - want| / (atol + rtol |want|) over the names (asserted <= 1 first)."""
    import torch

    worst = 0.0
    for name, g in got.items():
        w = want[name]
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda s, name=name: f"{name}: {s}")
        worst = max(worst, float(((g - w).abs() / (ATOL + RTOL * w.abs())).max()))
    return worst


def _case(rank: int, world: int, tp: int, dp: int, interleave: int, tie: bool, m: int, replicas: int = 1) -> dict:
    import torch

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_models import synthetic
    from hp_models.qwen3_5 import pipeline_qwen3_5
    from hp_pp import Schedule1F1B, ScheduleInterleaved1F1B, split_layers

    layers = 4
    cfg = _config(layers, tie)
    ref_losses, ref_grads, ref_params = _reference(layers, tie)
    mesh = init_device_mesh("cpu", (2, replicas, dp, tp), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    split = split_layers("auto", layers, 2, interleave)
    stages = pipeline_qwen3_5(_build(cfg), split, mesh)
    sched = (ScheduleInterleaved1F1B(stages, m, _loss) if interleave > 1 else Schedule1F1B(stages[0], m, _loss))
    params: dict[str, Any] = {}
    for s in stages:
        for n, p in s.module.named_parameters(remove_duplicate=False):
            params[n] = p
    unique = list({id(p): p for p in params.values()}.values())
    opt = torch.optim.AdamW(unique, lr=LR, weight_decay=0.0, foreach=True)
    first, last = stages[0].is_first, stages[-1].is_last
    coord = mesh.get_coordinate()
    dp_rank, n_dp = coord[1] * dp + coord[2], replicas * dp
    rows = slice(dp_rank * BATCH // n_dp, (dp_rank + 1) * BATCH // n_dp)
    out: dict[str, Any] = {"losses": [], "n_grads": 0}
    for step in range(STEPS):
        ids, tgt = synthetic.batch(0, step, BATCH, SEQ, cfg.vocab_size)
        opt.zero_grad()
        losses: list[Any] = []
        with CommDebugMode() as comm:
            sched.step(*([ids[rows]] if first else []), target=tgt[rows] if last else None, losses=losses)
        if step == 1:
            out["counts"] = {str(k): v for k, v in comm.get_comm_counts().items()}
        # the mean over the data-parallel ranks' parts of the batch (the last stage's ranks hold
        # the losses, each rank of a TP group the same)
        mean = torch.zeros(1, dtype=torch.float64)
        if last:
            assert len(losses) == m
            mean += torch.stack([x.reshape(()) for x in losses]).mean()
        torch.distributed.all_reduce(mean)
        if last:
            loss = float(mean[0]) / (n_dp * tp)
            assert abs(loss - ref_losses[step]) <= ATOL + RTOL * abs(ref_losses[step]), (step, loss, ref_losses[step])
            out["losses"].append(loss)
        if step == 0:
            grads = {n: _whole(p.grad) for n, p in params.items()}
            out["worst_grad"], out["n_grads"] = _worst(grads, ref_grads), len(grads)
        opt.step()
    out["worst_param"] = _worst({n: _whole(p.detach()) for n, p in params.items()}, ref_params)
    out["names"] = sorted(params)
    # FSDP units on this rank: each layer, and each stage root that holds the embedding, norm or head
    out["units"] = sum(len(s.module.model.layers) + int(s.is_first or s.is_last) for s in stages)
    return out


CASES = [
    # (tp, dp_shard, interleave, tie, microbatches)
    (2, 1, 1, False, 4),
    (2, 1, 1, True, 4),
    (2, 1, 2, True, 4),
    (1, 2, 1, False, 2),
    (1, 2, 1, True, 2),
    (1, 2, 2, True, 2),
]
# HSDP: 2 replicas of a shard group of one rank, untied, interleaved
HSDP_CASE = (1, 1, 2, False, 2)


@pytest.mark.parametrize("tp,dp,interleave,tie,m", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-x{c[2]}-{'tied' if c[3] else 'untied'}" for c in CASES])
def test_pp_composed_equals_one_process(pool4, tp, dp, interleave, tie, m):
    res = pool4.run(_case, tp, dp, interleave, tie, m)
    names = set().union(*(r["names"] for r in res))
    cfg = _config(4, tie)
    assert len(names) == len(_build_names(cfg)), (sorted(names), _build_names(cfg))
    if dp > 1:
        for r in res:
            counts = r["counts"]
            # gradients reduced once per step and FSDP unit (not per microbatch), parameters gathered once
            assert counts.get("reduce_scatter", 0) == r["units"], (counts, r["units"])
            assert counts.get("all_gather", 0) == r["units"], (counts, r["units"])
    print(f"[pp compose] pp=2 tp={tp} dp_shard={dp} interleave={interleave} tied={tie} m={m}: "
          f"{sum(r['n_grads'] for r in res)} gradient comparisons over the ranks, worst grad {max(r['worst_grad'] for r in res):.2e}, "
          f"worst param after {STEPS} AdamW {max(r['worst_param'] for r in res):.3f} (of the rtol/atol bound); "
          f"comms per step rank 0 {res[0]['counts']}")


def test_pp_hsdp_equals_one_process(pool4):
    tp, dp, interleave, tie, m = HSDP_CASE
    res = pool4.run(_case, tp, dp, interleave, tie, m, replicas=2)
    for r in res:
        # gradients all-reduced across the replicas once per step and FSDP unit
        assert r["counts"].get("all_reduce", 0) == r["units"], (r["counts"], r["units"])
    print(f"[pp compose] pp=2 dp_replicate=2 interleave={interleave} m={m}: {sum(r['n_grads'] for r in res)} "
          f"gradient comparisons over the ranks, worst grad {max(r['worst_grad'] for r in res):.2e}, worst param after {STEPS} AdamW "
          f"{max(r['worst_param'] for r in res):.3f}; comms per step rank 0 {res[0]['counts']}")


def _build_names(cfg) -> list[str]:
    import torch

    torch.manual_seed(0)
    return [n for n, _ in cfg.build().named_parameters(remove_duplicate=False)]


def _zero_bubble_on_fsdp(rank: int, world: int) -> str:
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import pipeline_qwen3_5
    from hp_pp import PipelineConfigError, ScheduleZeroBubble, split_layers

    cfg = _config(4, False)
    mesh = init_device_mesh("cpu", (2, 1, 2, 1), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    stages = pipeline_qwen3_5(_build(cfg), split_layers("auto", 4, 2), mesh)
    try:
        ScheduleZeroBubble(stages[0], 2, _loss)
    except PipelineConfigError as e:
        return str(e)
    return "no error"


def test_zero_bubble_on_fsdp_stages_is_refused_on_every_rank(pool4):
    for msg in pool4.run(_zero_bubble_on_fsdp):
        assert "fully_shard" in msg and "use Schedule1F1B" in msg, msg
