# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc"
"""Qwen3.5 pipeline-parallel on 2 gloo ranks equals one process, and torch.distributed.pipelining
(on 2 ranks and, for the comparison with torch, on 4).

Each case builds the model (fp32) with one seed on every rank, cuts it into stages
(``hp_pp.split_layers``: ``auto`` or explicit ranges, interleaved or not), steps a schedule for 3
AdamW steps and compares, on the rank holding each parameter, with plain single-process training
(rtol 1.5e-4, atol 1e-5):

- the loss and every gradient of the first step against one process on the whole batch;
- every loss and every parameter after the third AdamW step against one process that accumulates
  the same microbatches' gradients (loss / n_microbatches each) in the same order.  Against the
  whole batch the parameters differ by up to ~1e-3 (printed): fp32 gradients that differ only
  by summation order (<= 0.25 of the bound above) are normalized by AdamW, whose first steps move
  a parameter by about ``lr * g / |g|`` whatever ``|g|``, so a near-zero gradient's rounding
  becomes an lr-sized difference.  One process with whole-batch sums and with microbatch sums
  differ from each other by the same amount; neither is the pipeline's doing.

From the runner's own counters (``schedule.last_step``) every case also asserts the P2P sends and
receives of each rank against a formula and the most forward outputs each stage held at once
(1F1B: ``min(pp - r, n_microbatches)`` <= pp; GPipe: every microbatch).  Then the same split under
``torch.distributed.pipelining`` (GPipe, 1F1B, Interleaved1F1B at several chunk and microbatch
counts): per-stage gradients equal ours (worst difference printed) and each rank issues the same
number of P2P sends and receives per step as torch's schedule (counted from the P2P operation
lists it hands to ``_batch_p2p``), both equal to the formula.
"""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.testing import rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=240)
pool4 = rank_pool_fixture(4, timeout=300)  # pp=4 against torch only

BATCH, SEQ, M, STEPS, LR = 8, 16, 4, 3, 1e-2
RTOL, ATOL = 1.5e-4, 1e-5


def _dtype():
    import torch

    return torch.float32


def _config(layers: int, tie: bool):
    from hp_models.qwen3_5 import tiny_config

    return tiny_config(num_hidden_layers=layers, tie_word_embeddings=tie, vocab_size=512, hidden_size=128,
                       intermediate_size=256)


def _loss(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _reference(cfg, steps: int, microbatches: int | None = None):
    """One process: losses, first-step gradients and final parameters by name.  The whole batch
    at once, or (``microbatches``) its gradient accumulated over that many equal microbatches,
    each loss scaled by 1 / microbatches (the reported loss is their mean).  Accumulating, a tied
    embedding's two uses accumulate apart and are summed once at the end (embedding first), the
    order in which the pipeline's first and last stage sum their copies' gradients."""
    import torch

    from hp_models import synthetic

    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    model.to(_dtype())
    untied = microbatches is not None and cfg.tie_word_embeddings
    if untied:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, grads = [], {}
    for step in range(steps):
        ids, tgt = synthetic.batch(0, step, BATCH, SEQ, cfg.vocab_size)
        opt.zero_grad()
        if microbatches is None:
            loss = _loss(model(ids), tgt)
            loss.backward()
            losses.append(loss.item())
        else:
            parts = []
            for i, t in zip(ids.tensor_split(microbatches), tgt.tensor_split(microbatches)):
                loss = _loss(model(i), t)
                parts.append(loss.item())
                (loss * (1.0 / microbatches)).backward()
            losses.append(sum(parts) / microbatches)
            if untied:
                emb, head = model.model.embed_tokens.weight, model.lm_head.weight
                total = torch.zeros_like(emb.grad) + emb.grad + head.grad
                emb.grad.copy_(total)
                head.grad.copy_(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads, params


def _worst(got: dict, want: dict, check: bool = True) -> tuple[float, float, int]:
    """Largest |got - want| / (atol + rtol |want|) over matching names (<= 1 passes), the
    largest |got - want|, and the count."""
    import torch

    worst, worst_abs, n = 0.0, 0.0, 0
    for name, g in got.items():
        w = want[name]
        if check:
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda s, name=name: f"{name}: {s}")
        worst = max(worst, float(((g - w).abs() / (ATOL + RTOL * w.abs())).max()))
        worst_abs = max(worst_abs, float((g - w).abs().max()))
        n += 1
    return worst, worst_abs, n


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)


def expected_p2p(pp: int, nv: int, m: int, r: int) -> int:
    """Sends (= receives) of pp rank r per step: each of its virtual stages sends one activation
    per microbatch unless it is the last stage and one input gradient per microbatch unless it is
    the first; receives mirror them."""
    return m * sum((v < nv - 1) + (v > 0) for v in range(r, nv, pp))


def expected_peak(kind: str, pp: int, nv: int, m: int, v: int) -> int | None:
    """Most forward outputs virtual stage v holds at once (None: only bounded by m)."""
    r = v % pp
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(pp - r, m)
    return None


def _check_stats(sched, kind: str, m: int) -> dict:
    """The runner's counters of the step just run against the formulas; returns them."""
    st = sched.last_step
    pp, nv, r = sched.pp, sched.num_stages, sched.pp_rank
    want = expected_p2p(pp, nv, m, r)
    assert (st.sends, st.recvs) == (want, want), (kind, r, st, want)
    # overlap_p2p posts receives before the plan reaches them: the same receives, some earlier
    if sched.overlap_p2p:
        assert 1 <= st.posted_ahead <= st.recvs, (kind, r, st)
    else:
        assert st.posted_ahead == 0, (kind, r, st)
    for v, peak in st.peak_activations.items():
        exact = expected_peak(kind, pp, nv, m, v)
        if exact is not None:
            assert peak == exact, (kind, v, peak, exact)
        assert 1 <= peak <= m, (kind, v, peak)
        if kind == "1f1b":
            assert peak <= pp
    return {"sends": st.sends, "recvs": st.recvs, "peak": dict(st.peak_activations)}


_REFS: dict[tuple, Any] = {}  # per rank process: one-process references, reused across cases


def _cached_reference(cfg, layers: int, tie: bool, microbatches: int | None):
    key = (layers, tie, microbatches)
    if key not in _REFS:
        _REFS[key] = _reference(cfg, STEPS, microbatches)
    return _REFS[key]


def _case(rank: int, world: int, layers: int, spec: Any, interleave: int, kind: str, tie: bool,
          overlap: bool = True) -> dict:
    import torch

    from hp_dtensor import init_device_mesh
    from hp_models import synthetic
    from hp_models.qwen3_5 import pipeline_qwen3_5
    from hp_pp import ScheduleKind, schedule_for, split_layers

    cfg = _config(layers, tie)
    whole_losses, whole_grads, whole_params = _cached_reference(cfg, layers, tie, None)
    acc_losses, _, acc_params = _cached_reference(cfg, layers, tie, M)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    split = split_layers(spec, layers, 2, interleave)
    torch.manual_seed(0)
    full = cfg.build()
    full.init_weights()
    full.to(_dtype())
    stages = pipeline_qwen3_5(full, split, mesh)
    sk = ScheduleKind(kind)
    cls = schedule_for(sk)
    sched = cls(stages if sk.interleaved else stages[0], M, _loss, overlap_p2p=overlap)
    params: dict[str, Any] = {}
    for s in stages:
        for n, p in s.module.named_parameters(remove_duplicate=False):
            params[n] = p
    unique = list({id(p): p for p in params.values()}.values())
    opt = torch.optim.AdamW(unique, lr=LR, weight_decay=0.0, foreach=True)
    first, last = 0 in sched._stages, split.num_virtual - 1 in sched._stages
    out: dict[str, Any] = {"losses": [], "worst_grad": 0.0, "worst_param": 0.0, "n_grads": 0}
    for step in range(STEPS):
        ids, tgt = synthetic.batch(0, step, BATCH, SEQ, cfg.vocab_size)
        opt.zero_grad()
        losses: list[Any] = []
        sched.step(*([ids] if first else []), target=tgt if last else None, losses=losses)
        out["stats"] = _check_stats(sched, kind, M)
        if last:
            assert len(losses) == M
            loss = float(sum(float(x) for x in losses) / M)
            assert _close(loss, acc_losses[step]), (step, loss, acc_losses[step])
            if step == 0:
                assert _close(loss, whole_losses[0]), (loss, whole_losses[0])
            out["losses"].append(loss)
        if step == 0:
            grads = {n: p.grad for n, p in params.items()}
            out["worst_grad"], out["worst_grad_abs"], out["n_grads"] = _worst(grads, whole_grads)
        opt.step()
    final = {n: p.detach() for n, p in params.items()}
    out["worst_param"], out["worst_param_abs"], _ = _worst(final, acc_params)
    _, out["worst_param_whole_abs"], _ = _worst(final, whole_params, check=False)
    out["names"] = sorted(params)
    return out


CASES = [
    # (layers, spec, interleave, schedule)
    (4, "auto", 1, "1f1b"),
    (4, "auto", 1, "gpipe"),
    (4, "auto", 1, "zero_bubble"),
    (4, "auto", 2, "interleaved_1f1b"),
    (10, ["0-1, 4-8", "2-3, 9"], 2, "interleaved_1f1b"),
    (10, ["0-6", "7-9"], 1, "1f1b"),
]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layers,spec,interleave,kind", CASES, ids=[f"{c[0]}L-{c[3]}-{c[1]}" for c in CASES])
def test_pp_equals_one_process(pool2, layers, spec, interleave, kind, tie):
    res = pool2.run(_case, layers, spec, interleave, kind, tie)
    names = set(res[0]["names"]) | set(res[1]["names"])
    # every parameter of the whole model is on some stage (a tied one on both ends)
    n_all = len(set(_all_names(layers, tie)))
    assert len(names) == n_all, (len(names), n_all)
    worst = {k: max(r[k] for r in res) for k in ("worst_grad", "worst_grad_abs", "worst_param", "worst_param_abs",
                                                  "worst_param_whole_abs")}
    print(f"[pp] {layers} layers {spec} x{interleave} {kind} tie={tie}: {sum(r['n_grads'] for r in res)} grads, "
          f"worst grad {worst['worst_grad']:.3f} of bound (|diff| {worst['worst_grad_abs']:.1e}) vs whole batch; "
          f"after {STEPS} AdamW worst param {worst['worst_param']:.3f} of bound (|diff| "
          f"{worst['worst_param_abs']:.1e}) vs accumulated microbatches, |diff| {worst['worst_param_whole_abs']:.1e} "
          f"vs whole batch; P2P/rank {[r['stats']['sends'] + r['stats']['recvs'] for r in res]}, peak stored "
          f"activations {[r['stats']['peak'] for r in res]}; losses {res[1]['losses']}")


@pytest.mark.parametrize("layers,spec,interleave,kind", [CASES[1], CASES[3]], ids=["4L-gpipe", "4L-interleaved"])
def test_receives_at_need_same_numbers(pool2, layers, spec, interleave, kind):
    """``overlap_p2p=False``: every receive posted only when the plan reaches it."""
    res = pool2.run(_case, layers, spec, interleave, kind, True, overlap=False)
    print(f"[pp] overlap_p2p=False {kind}: worst grad {max(r['worst_grad'] for r in res):.3f} of bound, "
          f"worst param {max(r['worst_param'] for r in res):.3f} of bound")


def _all_names(layers: int, tie: bool) -> list[str]:
    cfg = _config(layers, tie)
    import torch

    torch.manual_seed(0)
    return [n for n, _ in cfg.build().named_parameters(remove_duplicate=False)]


# ---------------------------------------------------------------- against torch.distributed.pipelining
def _torch_case(rank: int, world: int, layers: int, spec: Any, interleave: int, kind: str, m: int) -> dict:
    """Ours and torch's schedules on the same split of the same (untied) model, one warm-up step
    (shape exchange) then one counted step: per-stage gradients and P2P operations."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tpp
    from torch.distributed.pipelining import schedules as tsched_mod

    from hp_dtensor import init_device_mesh
    from hp_models import synthetic
    from hp_models.qwen3_5 import pipeline_qwen3_5, split_qwen3_5
    from hp_pp import ScheduleKind, schedule_for, split_layers

    cfg = _config(layers, False)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    split = split_layers(spec, layers, world, interleave)
    sk = ScheduleKind(kind)
    nv = split.num_virtual
    ids, tgt = synthetic.batch(0, 0, BATCH, SEQ, cfg.vocab_size)

    def fresh():
        torch.manual_seed(0)
        full = cfg.build()
        full.init_weights()
        return full.to(_dtype())

    # ours
    stages = pipeline_qwen3_5(fresh(), split, mesh)
    ours = schedule_for(sk)(stages if sk.interleaved else stages[0], m, _loss)
    first, last = 0 in ours._stages, nv - 1 in ours._stages
    args = [ids] if first else []
    ours.step(*args, target=tgt if last else None)
    assert ours.last_step.shape_messages > 0  # the first step exchanges shapes ...
    for s in stages:
        s.module.zero_grad()
    ours.step(*args, target=tgt if last else None)
    assert ours.last_step.shape_messages == 0  # ... and later steps reuse them
    mine = _check_stats(ours, kind, m)

    # torch: every P2P operation of its schedules goes through the list handed to _batch_p2p
    chunks = split_qwen3_5(fresh(), split, rank)
    group = mesh.get_group(0)
    tstages = [tpp.PipelineStage(c, v, nv, torch.device("cpu"), group=group)
               for c, v in zip(chunks, split.stages_of(rank))]
    tcls = {ScheduleKind.GPIPE: tpp.ScheduleGPipe, ScheduleKind.ONE_F_ONE_B: tpp.Schedule1F1B,
            ScheduleKind.INTERLEAVED_1F1B: tpp.ScheduleInterleaved1F1B}[sk]
    tsched = tcls(tstages if sk.interleaved else tstages[0], n_microbatches=m, loss_fn=_loss)
    tsched.step(*args, target=tgt if last else None)
    for c in chunks:
        c.zero_grad()
    counted = {"send": 0, "recv": 0}
    real = tsched_mod._batch_p2p

    def counting(ops, desc=None):
        for op in ops:
            counted["send" if op.op is dist.isend else "recv"] += 1
        return real(ops, desc)

    tsched_mod._batch_p2p = counting
    try:
        tsched.step(*args, target=tgt if last else None)
    finally:
        tsched_mod._batch_p2p = real
    assert (mine["sends"], mine["recvs"]) == (counted["send"], counted["recv"]), (rank, mine, counted)
    worst = 0.0
    n = 0
    for s, c in zip(stages, chunks):
        got = dict(s.module.named_parameters())
        for name, p in c.named_parameters():
            torch.testing.assert_close(got[name].grad, p.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda msg, name=name: f"{name}: {msg}")
            worst = max(worst, float((got[name].grad - p.grad).abs().max()))
            n += 1
    return {"ours": mine, "torch": counted, "worst_abs": worst, "n": n}


TORCH_CASES = [
    # (layers, spec, interleave, schedule, microbatches)
    (4, "auto", 1, "gpipe", 4),
    (4, "auto", 1, "1f1b", 4),
    (4, "auto", 1, "1f1b", 8),
    (4, "auto", 2, "interleaved_1f1b", 2),
    (4, "auto", 2, "interleaved_1f1b", 4),
    (4, "auto", 2, "interleaved_1f1b", 8),
    (6, "auto", 3, "interleaved_1f1b", 4),
    (10, ["0-1, 4-8", "2-3, 9"], 2, "interleaved_1f1b", 4),
]


# pp=4 on 4 ranks: a first, two middle stages and a last, so sends and receives run both ways on
# ranks with two neighbours, and interleaving wraps from the last rank to the first.
TORCH_CASES_PP4 = [
    (4, "auto", 1, "gpipe", 4),
    (4, "auto", 1, "1f1b", 8),
    (8, "auto", 2, "interleaved_1f1b", 4),
    (8, "auto", 2, "interleaved_1f1b", 8),
]


@pytest.mark.parametrize("layers,spec,interleave,kind,m", TORCH_CASES,
                         ids=[f"{c[0]}L-{c[3]}-x{c[2]}-m{c[4]}" for c in TORCH_CASES])
def test_against_torch_pipelining(pool2, layers, spec, interleave, kind, m):
    _against_torch(pool2, layers, spec, interleave, kind, m)


@pytest.mark.parametrize("layers,spec,interleave,kind,m", TORCH_CASES_PP4,
                         ids=[f"pp4-{c[0]}L-{c[3]}-x{c[2]}-m{c[4]}" for c in TORCH_CASES_PP4])
def test_against_torch_pipelining_pp4(pool4, layers, spec, interleave, kind, m):
    _against_torch(pool4, layers, spec, interleave, kind, m)


def _against_torch(pool, layers, spec, interleave, kind, m):
    res = pool.run(_torch_case, layers, spec, interleave, kind, m)
    print(f"[vs torch] pp={len(res)} {layers}L {kind} x{interleave} m={m}: {sum(r['n'] for r in res)} per-stage "
          f"grads equal, "
          f"worst |diff| {max(r['worst_abs'] for r in res):.2e}; P2P (send, recv) per step by rank ours "
          f"{[(r['ours']['sends'], r['ours']['recvs']) for r in res]} = torch "
          f"{[(r['torch']['send'], r['torch']['recv']) for r in res]} = formula")
