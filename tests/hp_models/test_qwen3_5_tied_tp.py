# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Tied embeddings (``tie_word_embeddings=True``) at tp=2 against transformers: the tie survives
``parallelize_qwen3_5_tp`` in either order of load and parallelize (one DTensor parameter whose
gradient sums both uses), logits, loss and gradients equal HF's, and three optimizer steps keep
embedding and lm_head equal to each other and to a one-process tied run."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=240)


def _cfg() -> Any:
    from hp_models.qwen3_5 import tiny_config

    return tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, chunk_size=8, tie_word_embeddings=True)


def _hf_checkpoint(folder: str) -> Any:
    """A perturbed tied HF model (same on every rank), saved by rank 0 with save_pretrained."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3_5ForCausalLM as HF
    from transformers import Qwen3_5TextConfig

    cfg = _cfg()
    torch.manual_seed(0)
    hf = HF(Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "model_type"}))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    if dist.get_rank() == 0:
        hf.save_pretrained(folder)
    dist.barrier()
    return hf


def _tied_tp(rank: int, world: int, folder: str, load_first: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import DTensor, init_device_mesh
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, parallelize_qwen3_5_tp
    from hp_tp import loss_parallel

    hf = _hf_checkpoint(folder)
    cfg = _cfg()
    adapter = Qwen3_5StateDictAdapter(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(123 + rank)  # random init differs per rank: only the load may make them agree
    model = cfg.build()
    if load_first:
        read = adapter.load_into(model, folder)
        parallelize_qwen3_5_tp(model, mesh)
    else:
        parallelize_qwen3_5_tp(model, mesh)
        read = adapter.load_into(model, folder)
    torch.manual_seed(7)
    single = cfg.build()
    adapter.load_into(single, folder)

    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    out: dict[str, Any] = {
        "one_param": head is emb and isinstance(emb, DTensor),
        "n_params": (len(list(model.parameters())), len(list(single.parameters()))),
        "embed_reads": read.count("model.embed_tokens.weight"),
        "lm_head_reads": read.count("lm_head.weight"),
    }
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    hf_logits = hf(ids).logits
    F.cross_entropy(hf_logits.flatten(0, 1), tgt.flatten()).backward()
    hf_grads = adapter.from_hf({k: p.grad for k, p in hf.named_parameters()})

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(single.parameters(), lr=0.5, momentum=0.9)
    tie_held = []
    for step in range(3):
        logits = model(ids)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
            loss.backward()
        ref_loss = F.cross_entropy(single(ids).flatten(0, 1), tgt.flatten())
        ref_loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref_loss, rtol=1.5e-4, atol=1e-5)
        if step == 0:
            torch.testing.assert_close(logits.full_tensor(), hf_logits, rtol=1.5e-4, atol=1e-5)
            for name, p in model.named_parameters():
                atol = max(1e-5, 1e-3 * hf_grads[name].abs().max().item())
                torch.testing.assert_close(p.grad.full_tensor(), hf_grads[name], rtol=1e-3, atol=atol,
                                           msg=lambda m, n=name: f"{n}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        tie_held.append(model.lm_head.weight is model.model.embed_tokens.weight
                        and torch.equal(model.lm_head.weight.full_tensor(), model.model.embed_tokens.weight.full_tensor()))
    for (name, p), (_, q) in zip(model.named_parameters(), single.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    out["tie_held"] = tie_held
    out["single_tied"] = single.lm_head.weight is single.model.embed_tokens.weight
    return out


@pytest.mark.parametrize("load_first", [True, False], ids=["load_then_parallelize", "parallelize_then_load"])
def test_tied_tp2_matches_transformers_and_stays_tied(pool2: RankPool, load_first: bool) -> None:
    folder = tempfile.mkdtemp()
    try:
        for res in pool2.run(_tied_tp, folder, load_first, timeout=240):
            assert res["one_param"]
            assert res["n_params"][0] == res["n_params"][1]  # no second copy of the embedding
            assert res["embed_reads"] == 1 and res["lm_head_reads"] == 0
            assert res["tie_held"] == [True, True, True]
            assert res["single_tied"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _split_two_ways(rank: int, world: int) -> str:
    import torch

    from hp_dtensor import init_device_mesh
    from hp_tp import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    emb, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    root = torch.nn.ModuleDict({"emb": emb, "head": head})
    try:
        # ColwiseParallel splits the Embedding on dim 1 but the Linear on dim 0: no single layout
        parallelize_module(root, mesh, {"emb": ColwiseParallel(), "head": ColwiseParallel()})
    except ValueError as e:
        return str(e)
    return "no error"


def test_tie_split_two_ways_is_refused_on_every_rank(pool2: RankPool) -> None:
    for msg in pool2.run(_split_two_ways):
        assert "tied parameter shared by Embedding.weight and Linear.weight" in msg and "Shard(dim=1)" in msg
