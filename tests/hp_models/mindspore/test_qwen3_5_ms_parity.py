# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""Qwen3.5 on MindSpore in one process against the torch model on the same HF weights: a torch
rank builds the tiny model from a seed and writes its HF safetensors checkpoint; the MindSpore
model (protocol Modules, Gated DeltaNet and gated attention in PyNative) loads that file through
the same state-dict adapter, takes the same token ids, and gives the same logits, loss and
gradient of every parameter in float32 (rtol 1.5e-4, atol 1e-5), untied and tied, two seeds.
The torch model is checked against HF transformers elsewhere, so this carries over to HF."""

from __future__ import annotations

import numpy as np
import pytest
from qwen_ms_cases import ms_run, torch_reference, worst

from hp_dtensor.testing import RankPool, rank_pool_fixture

torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}
SEEDS = (0, 1)


@pytest.mark.parametrize("tie", [False, True])
def test_logits_loss_and_every_gradient_equal_torch(torch_pool: RankPool, tie: bool, tmp_path) -> None:
    for seed in SEEDS:
        folder = str(tmp_path / f"seed{seed}")
        (ref,) = torch_pool.run(torch_reference, seed, tie, folder)
        got = ms_run(seed, tie, folder)
        np.testing.assert_allclose(got["logits"], ref["logits"], err_msg=f"seed {seed} logits", **TOL)
        np.testing.assert_allclose(got["loss"], ref["loss"], err_msg=f"seed {seed} loss", **TOL)
        assert set(got["grads"]) == set(ref["grads"])
        # a tied model has one embedding matrix; an untied one also a head
        assert ("lm_head.weight" in ref["grads"]) is not tie
        for name in sorted(ref["grads"]):
            np.testing.assert_allclose(got["grads"][name], ref["grads"][name], err_msg=f"seed {seed} {name}", **TOL)
        logit_abs, logit_share = worst(ref["logits"], got["logits"])
        grad_abs, grad_share, grad_name = max(
            (worst(ref["grads"][n], got["grads"][n]) + (n,) for n in ref["grads"]), key=lambda t: t[1]
        )
        print(f"tie={tie} seed={seed}: logits max abs diff {logit_abs:.2e} ({logit_share:.2f} of tol), loss "
              f"{ref['loss']:.7f} vs {got['loss']:.7f}, {len(ref['grads'])} gradients: worst {grad_share:.2f} of tol "
              f"(abs {grad_abs:.2e}) at {grad_name}")
