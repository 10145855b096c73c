"""The MoE model's pipeline stages on one process, in float64: three stages (layers 0 | 1-2 | 3)
run one after another, passing the packed hidden states and routing statistics, give the whole
model's logits, load-balancing loss, counts per (layer, expert) and every parameter's gradient of
cross entropy plus the weighted router loss, and of the router loss alone (whose gradient reaches
the first stages' routers through the statistics only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hp_models.qwen3_5_moe import tiny_moe_config
from hp_models.qwen3_5_moe.pipeline import pack, split_qwen3_5_moe, statistics_size, unpack
from hp_pp import StageSplit


def _model() -> Any:
    torch.manual_seed(0)
    model = tiny_moe_config().build()
    model.init_weights()
    return model.to(torch.float64)


@pytest.mark.parametrize("with_ce", [True, False], ids=["ce-plus-router-loss", "router-loss-alone"])
def test_stages_equal_the_whole_model_in_float64(with_ce: bool) -> None:
    cfg = tiny_moe_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    whole = _model()
    logits = whole(ids)
    aux = whole.aux_loss()
    (F.cross_entropy(logits.flatten(0, 1), tgt.flatten()) * with_ce + cfg.router_aux_loss_coef * aux).backward()
    want_counts = torch.stack([b.tokens_per_expert for b in whole.moe_blocks()]).to(torch.float64)

    split = StageSplit(pp=3, interleave=1, num_layers=4, layers=((0,), (1, 2), (3,)))
    model = _model()
    stages = [s for r in range(3) for s in split_qwen3_5_moe(model, split, r)]
    x = ids
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == (2, 16 + 1, cfg.hidden_size)  # 49 statistics fit one extra row per sample
    got = stages[-1](x)
    got_aux = stages[-1].aux_loss()
    (F.cross_entropy(got.flatten(0, 1), tgt.flatten()) * with_ce + cfg.router_aux_loss_coef * got_aux).backward()

    torch.testing.assert_close(got, logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_aux, aux, rtol=1e-12, atol=1e-12)
    assert torch.equal(stages[-1].expert_counts(), want_counts)
    want = dict(whole.named_parameters())
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    assert sorted(names) == sorted(n for n, p in want.items() if p.grad is not None)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-13, msg=name)
    for i in range(4):  # every layer's router has a gradient, also from the router loss alone
        grad = dict(model.named_parameters())[f"model.layers.{i}.mlp.gate.weight"].grad
        assert grad is not None and grad.abs().sum() > 0


def test_pack_round_trip_and_dtype_check() -> None:
    hidden = torch.randn(2, 3, 4, dtype=torch.float64)
    stats = torch.arange(10, dtype=torch.float64)
    packed = pack(hidden, stats)
    assert packed.shape == (2, 3 + 2, 4)  # 10 statistics over 2 samples of 4: 2 extra rows
    h, s = unpack(packed, 10)
    assert torch.equal(h, hidden) and torch.equal(s, stats)
    assert statistics_size(tiny_moe_config()) == 4 * 8 + 8 + 1
    with pytest.raises(ValueError, match="exact in float32 or float64 only; the hidden states are torch.bfloat16"):
        pack(hidden.to(torch.bfloat16), stats)
