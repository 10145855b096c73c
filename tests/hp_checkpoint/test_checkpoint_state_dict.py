# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
"""Name-keyed model and optimizer state dicts on one process (plain tensors): creating AdamW's
state before its first step changes nothing (the run stays bit-identical), state moves by
parameter name even when the optimizer lists parameters in another order, and misuse is refused
with a message naming what is wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hp_checkpoint.dcp import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    out = []
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def test_creating_state_before_the_first_step_changes_nothing() -> None:
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    osd = get_optimizer_state_dict(b, ob)
    assert sorted(osd["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(float(st["step"]) == 0 for st in osd["state"].values())
    assert _steps(a, oa, range(4)) == _steps(b, ob, range(4))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_state_moves_by_name_not_position() -> None:
    src = _model()
    osrc = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _steps(src, osrc, range(3))
    saved = copy.deepcopy({"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, osrc)})
    dst = _model()
    odst = torch.optim.AdamW(list(dst.parameters())[::-1], lr=5.0)  # other order, other lr
    set_model_state_dict(dst, saved["model"])
    set_optimizer_state_dict(dst, odst, saved["optim"])
    assert odst.param_groups[0]["lr"] == 1e-2
    names = dict(dst.named_parameters())
    for fqn, st in saved["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(odst.state[names[fqn]][k], v), (fqn, k)
    assert _steps(dst, odst, range(3, 6)) == _steps(src, osrc, range(3, 6))


def test_misuse_is_refused() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    osd = get_optimizer_state_dict(model, opt)
    stranger = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=1e-2)
    with pytest.raises(ValueError, match="not a parameter of Sequential"):
        get_optimizer_state_dict(model, stranger)
    bad = {**osd, "state": {**osd["state"], "9.weight": {}}}
    with pytest.raises(ValueError, match=r"unknown parameters \['9.weight'\]"):
        set_optimizer_state_dict(model, opt, bad)
    two = {**osd, "param_groups": osd["param_groups"] * 2}
    with pytest.raises(ValueError, match="2 parameter groups saved, the optimizer has 1"):
        set_optimizer_state_dict(model, opt, two)
    with pytest.raises(ValueError, match="global shape"):
        set_model_state_dict(model, {**get_model_state_dict(model), "0.weight": torch.zeros(3, 3)})
    fresh = _model()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ((fresh(torch.ones(1, 4))) ** 2).sum().backward()
    with pytest.raises(ValueError, match="parameters hold gradients"):
        get_optimizer_state_dict(fresh, fopt)
