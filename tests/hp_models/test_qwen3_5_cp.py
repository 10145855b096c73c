# mypy: disable-error-code="no-untyped-def,no-any-return,attr-defined,union-attr,arg-type,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Qwen3.5 (hybrid Gated DeltaNet and gated full attention) under context parallelism on 4 gloo
ranks against one process on the whole sequence with the same weights: loss, every parameter's
gradient and the weights after each of 3 AdamW steps, for colossal and ulysses at cp=2, colossal
at cp=2 x tp=2 (the TP plan, sequence parallel off), ulysses and hybrid at cp=4, and colossal and
ulysses at cp=2 x dp_shard=2 under FSDP over the 4 ``dp_shard * cp`` ranks.  The data is
packed documents (EOD): every rank holds several documents, positions restart per document, and
the one-process reference runs each document alone (attention and the DeltaNet state never cross
a document).  Collectives are counted per attention layer."""

from __future__ import annotations

import copy
import random
import warnings
from dataclasses import dataclass

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=300)

RTOL, ATOL = 1.5e-4, 1e-5


@dataclass(frozen=True)
class ModelCase:
    cp: int
    method: str
    ulysses: int | None = None
    tp: int = 1
    eod: bool = True
    batch: int = 2
    seq: int = 128
    seed: int = 0


def _documents(rng: random.Random, seq: int) -> list[int]:
    """Cumulative document ends, documents of 4 to 12 tokens (the last takes what is left)."""
    ends, at = [], 0
    while seq - at > 12:
        at += rng.randint(4, 12)
        ends.append(at)
    return [*ends, seq]


def _batch(case: ModelCase, step: int, vocab: int):
    """Tokens, next-token labels (ignored at each document's last token) and documents."""
    import torch

    rng = random.Random(case.seed * 100 + step)
    g = torch.Generator().manual_seed(case.seed * 100 + step)
    ids = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    actual = [_documents(rng, case.seq) for _ in range(case.batch)] if case.eod else None
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    for r, ends in enumerate(actual or []):
        labels[r, [e - 1 for e in ends]] = -100
    return ids, labels, actual


def _reference_logits(model, ids, actual):
    """The one-process model on the whole sequence; with packed documents each document alone.
    The model is causal, so a document right-padded to the longest one has exactly its own
    outputs on its tokens: the documents run as one padded batch."""
    import torch

    if actual is None:
        return model(ids)
    docs = [(r, a, e) for r, ends in enumerate(actual) for a, e in zip([0, *ends[:-1]], ends)]
    longest = max(e - a for _, a, e in docs)
    padded = torch.zeros(len(docs), longest, dtype=ids.dtype)
    for i, (r, a, e) in enumerate(docs):
        padded[i, :e - a] = ids[r, a:e]
    out = model(padded)
    rows: list[list] = [[] for _ in actual]
    for i, (r, a, e) in enumerate(docs):
        rows[r].append(out[i, :e - a])
    return torch.stack([torch.cat(parts) for parts in rows])


def _meshes(world: int, case: ModelCase):
    from hp_dtensor import init_device_mesh

    if case.tp > 1:
        mesh = init_device_mesh("cpu", (case.cp, case.tp), mesh_dim_names=("cp", "tp"))
        return mesh["cp"], mesh["tp"]
    if case.method == "hybrid":
        assert case.ulysses is not None
        return init_device_mesh("cpu", (case.cp // case.ulysses, case.ulysses),
                                mesh_dim_names=("cp_ring", "cp_ulysses")), None
    if case.cp == world:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), None
    return init_device_mesh("cpu", (world // case.cp, case.cp), mesh_dim_names=("dp", "cp"))["cp"], None


def run_model_case(rank: int, world: int, case: ModelCase) -> dict:
    import torch
    import torch.nn.functional as F

    from hp_cp import ContextParallel, ContextParallelConfig, CPMethod, MaskCompression
    from hp_dtensor import CommDebugMode
    from hp_models.qwen3_5 import (
        cp_cross_entropy,
        parallelize_qwen3_5_cp,
        parallelize_qwen3_5_tp,
        sum_cp_gradients,
        tiny_config,
    )

    cp_mesh, tp_mesh = _meshes(world, case)
    cp = ContextParallel(cp_mesh, ContextParallelConfig(
        degree=case.cp, method=CPMethod.parse(case.method), ulysses_degree=case.ulysses,
        compression=MaskCompression.EOD if case.eod else MaskCompression.CAUSAL,
    ))
    # two full-attention layers among four: both kinds of token mixer appear twice
    cfg = tiny_config(chunk_size=8, full_attention_interval=2, hidden_size=128, intermediate_size=256, vocab_size=512,
                      head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(case.seed)
    ref = cfg.build().double()
    ref.init_weights()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = copy.deepcopy(ref)
    sp_warnings = []
    if tp_mesh is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = parallelize_qwen3_5_tp(model, tp_mesh, loss_parallel=False, context_parallel=case.cp)
        sp_warnings = [str(w.message) for w in caught]
    parallelize_qwen3_5_cp(model, cp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def rel(got, want) -> float:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        return float(((got - want).abs() / (want.abs() + ATOL / RTOL)).max())

    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    counts = {}
    for step in range(3):
        ids, labels, actual = _batch(case, step, cfg.vocab_size)
        ref_logits = _reference_logits(ref, ids, actual)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        ref_loss.backward()

        with CommDebugMode() as fwd:
            if step == 0:
                fwd.track_module(model)
            logits = model(cp.split(ids, dim=1), actual_seq_len=actual)
            loss = cp_cross_entropy(logits, cp.split(labels, dim=1), cp)
        with CommDebugMode() as bwd:
            loss.backward()
        if step == 0:
            counts = {"fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts(),
                      "by_module": fwd.get_comm_counts_by_module()}
        sum_cp_gradients(model.parameters(), cp)
        worst["loss"] = max(worst["loss"], rel(loss.detach(), ref_loss.detach()))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            try:
                worst["grad"] = max(worst["grad"], rel(full(p.grad), q.grad))
            except AssertionError as e:
                raise AssertionError(f"step {step} grad {name}: {e}") from None
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            try:
                worst["param"] = max(worst["param"], rel(full(p.detach()), q.detach()))
            except AssertionError as e:
                raise AssertionError(f"step {step} param {name}: {e}") from None
    docs_per_rank = []
    if actual is not None:
        for seg in cp.segments(case.seq):
            docs_per_rank.append(len({sum(e <= p for e in actual[0]) for p in range(seg.start, seg.end)}))
    return {"worst": worst, "docs": sum(docs_per_rank), "sp_warnings": sp_warnings, **counts}


CASES = {
    "colossal_cp2": ModelCase(cp=2, method="colossal", seed=1),
    "colossal_cp2_causal": ModelCase(cp=2, method="colossal", eod=False, batch=1, seed=2),
    "ulysses_cp2": ModelCase(cp=2, method="ulysses", seed=3),
    "colossal_cp2_tp2": ModelCase(cp=2, method="colossal", tp=2, seed=4),
    "ulysses_cp4": ModelCase(cp=4, method="ulysses", seed=5),
    "hybrid_cp4_u2": ModelCase(cp=4, method="hybrid", ulysses=2, seed=6),
}


def _expected(case: ModelCase) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
    """Per full-attention layer and per Gated DeltaNet layer, the collectives its own forward
    issues (its projections' TP collectives are counted on them) and, for the whole backward, what
    CP adds per layer: the ring's exchanges over ``cp / ulysses`` participants (``ring - 1``
    forward, ``2 * ring - 1`` backward), four all-to-alls each way under ulysses, and the DeltaNet's
    two all-gathers (halo, chunk states) per CP mesh dim, reduce-scatters backward."""
    u = case.ulysses if case.method == "hybrid" else (case.cp if case.method == "ulysses" else 1)
    ring = case.cp // u
    dims = 2 if case.method == "hybrid" else 1
    attn_f: dict[str, int] = {}
    attn_b: dict[str, int] = {}
    if ring > 1:
        attn_f["send_recv"], attn_b["send_recv"] = ring - 1, 2 * ring - 1
    if u > 1:
        attn_f["all_to_all"] = attn_b["all_to_all"] = 4
    return attn_f, attn_b, {"all_gather": 2 * dims}, {"reduce_scatter": 2 * dims}


@pytest.mark.parametrize("name", list(CASES))
def test_qwen3_5_under_cp_equals_one_process(pool4: RankPool, name: str) -> None:
    case = CASES[name]
    results = pool4.run(run_model_case, case)
    attn_f, attn_b, delta_f, delta_b = _expected(case)
    layers = ["linear_attention", "full_attention"] * 2
    n_attn = layers.count("full_attention")
    n_delta = layers.count("linear_attention")
    for r in results:
        for i, kind in enumerate(layers):
            key = f"model.layers.{i}.self_attn" if kind == "full_attention" else f"model.layers.{i}.linear_attn"
            assert r["by_module"].get(key, {}) == (attn_f if kind == "full_attention" else delta_f), (key, r)
        if case.tp == 1:
            # the whole forward: the mixers' collectives plus the loss's two sums per CP mesh dim
            fwd = {k: n_attn * attn_f.get(k, 0) + n_delta * delta_f.get(k, 0) for k in {*attn_f, *delta_f}}
            fwd["all_reduce"] = 2 * (2 if case.method == "hybrid" else 1)
            assert r["fwd"] == fwd, (r["fwd"], fwd)
            bwd = {k: n_attn * attn_b.get(k, 0) + n_delta * delta_b.get(k, 0) for k in {*attn_b, *delta_b}}
            assert r["bwd"] == bwd, (r["bwd"], bwd)
        if case.tp > 1:
            # sequence parallel, on by default in the TP plan, is ignored under CP with a warning
            assert len(r["sp_warnings"]) == 1 and "sequence_parallel is ignored" in r["sp_warnings"][0], r
    worst = {k: max(r["worst"][k] for r in results) for k in results[0]["worst"]}
    docs = [r["docs"] for r in results]
    if case.eod:
        assert min(docs) >= 2 * 2, docs  # several documents in each of a rank's two chunks
    print(f"Qwen3.5 {name}: 3 AdamW steps on {case.batch}x{case.seq} tokens over {len(results)} ranks, "
          f"documents per rank (row 0) {docs}; attention layer fwd {attn_f}, DeltaNet layer fwd {delta_f}; "
          f"worst relative difference loss {worst['loss']:.2e}, grads {worst['grad']:.2e}, "
          f"weights {worst['param']:.2e}")


def run_fsdp_case(rank: int, world: int, case: ModelCase) -> dict:
    """cp x dp_shard on ``world`` ranks, FSDP over the flattened ``dp_shard * cp`` ranks (``fsdp``,
    the CP ranks innermost) with summed gradients: each data-parallel rank takes its rows of the
    batch, each CP rank its share of their sequence; the loss of a rank's rows is weighted by its
    share of the batch's counted tokens, so the summed gradients are those of the whole batch's
    mean loss on one process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hp_cp import ContextParallel, ContextParallelConfig, CPMethod, MaskCompression
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import apply_fsdp_qwen3_5, cp_cross_entropy, parallelize_qwen3_5_cp, tiny_config

    dp = world // case.cp
    mesh = init_device_mesh("cpu", (dp, case.cp), mesh_dim_names=("dp_shard", "cp"))
    fsdp = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    cp = ContextParallel(mesh["cp"], ContextParallelConfig(
        degree=case.cp, method=CPMethod.parse(case.method), ulysses_degree=case.ulysses,
        compression=MaskCompression.EOD if case.eod else MaskCompression.CAUSAL,
    ))
    cfg = tiny_config(chunk_size=8, full_attention_interval=2, hidden_size=128, intermediate_size=256, vocab_size=512,
                      head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(case.seed)
    ref = cfg.build().double()
    ref.init_weights()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = copy.deepcopy(ref)
    parallelize_qwen3_5_cp(model, cp)
    apply_fsdp_qwen3_5(model, fsdp, sum_gradients=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

    def rel(got, want) -> float:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        return float(((got - want).abs() / (want.abs() + ATOL / RTOL)).max())

    d = mesh.get_local_rank("dp_shard")
    per = case.batch // dp
    rows = slice(d * per, (d + 1) * per)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    sharded = 0
    for step in range(3):
        ids, labels, actual = _batch(case, step, cfg.vocab_size)
        ref_logits = _reference_logits(ref, ids, actual)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        ref_loss.backward()

        mine = labels[rows]
        weight = float((mine != -100).sum()) / float((labels != -100).sum())
        logits = model(cp.split(ids[rows], dim=1), actual_seq_len=actual[rows] if actual else None)
        loss = cp_cross_entropy(logits, cp.split(mine, dim=1), cp) * weight
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group("dp_shard"))
        worst["loss"] = max(worst["loss"], rel(total, ref_loss.detach()))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            sharded += int(p.grad.placements[0].is_shard())
            try:
                worst["grad"] = max(worst["grad"], rel(p.grad.full_tensor(), q.grad))
            except AssertionError as e:
                raise AssertionError(f"step {step} grad {name}: {e}") from None
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            try:
                worst["param"] = max(worst["param"], rel(p.detach().full_tensor(), q.detach()))
            except AssertionError as e:
                raise AssertionError(f"step {step} param {name}: {e}") from None
    return {"worst": worst, "sharded": sharded, "params": len(list(model.parameters()))}


FSDP_CASES = {
    "colossal_cp2_dp_shard2_fsdp4": ModelCase(cp=2, method="colossal", batch=4, seed=7),
    "ulysses_cp2_dp_shard2_fsdp4_causal": ModelCase(cp=2, method="ulysses", eod=False, batch=4, seed=8),
}


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_qwen3_5_cp_times_dp_shard_under_fsdp_equals_one_process(pool4: RankPool, name: str) -> None:
    case = FSDP_CASES[name]
    results = pool4.run(run_fsdp_case, case)
    for r in results:  # every parameter sharded over dp_shard * cp, its gradient too
        assert r["sharded"] == 3 * r["params"], r
    worst = {k: max(r["worst"][k] for r in results) for k in results[0]["worst"]}
    print(f"Qwen3.5 {name}: 3 AdamW steps on {case.batch}x{case.seq} tokens, dp_shard 2 x cp 2, FSDP over 4 ranks; "
          f"worst relative difference loss {worst['loss']:.2e}, grads {worst['grad']:.2e}, "
          f"weights {worst['param']:.2e}")
