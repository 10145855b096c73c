# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""Qwen3.5 on MindSpore in one process against the torch model on the same HF weights: a torch
rank builds the tiny model from a seed and writes its HF safetensors checkpoint; the MindSpore
model (protocol Modules, Gated DeltaNet and gated attention in PyNative) loads that file through
the same state-dict adapter, takes the same token ids, and gives the same logits, loss and
gradient of every parameter in float32 (rtol 1.5e-4, atol 1e-5), untied and tied, two seeds.
The torch model is checked against HF transformers elsewhere, so this carries over to HF.
A checkpoint of another config is refused naming the tensor, before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest
from qwen_ms_cases import config, ms_run, torch_reference, worst

from hp_dtensor.testing import RankPool, rank_pool_fixture

torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def references(torch_pool: RankPool, tmp_path_factory) -> dict[tuple[int, bool], tuple[str, dict]]:
    """(seed, tie) -> (HF checkpoint folder, the torch model's figures on it)."""
    out = {}
    for tie in (False, True):
        for seed in SEEDS:
            folder = str(tmp_path_factory.mktemp(f"qwen-tie{int(tie)}-seed{seed}"))
            (ref,) = torch_pool.run(torch_reference, seed, tie, folder)
            out[seed, tie] = folder, ref
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_logits_loss_and_every_gradient_equal_torch(references, tie: bool) -> None:
    for seed in SEEDS:
        folder, ref = references[seed, tie]
        got = ms_run(seed, tie, folder)
        np.testing.assert_allclose(got["logits"], ref["logits"], err_msg=f"seed {seed} logits", **TOL)
        np.testing.assert_allclose(got["loss"], ref["loss"], err_msg=f"seed {seed} loss", **TOL)
        assert set(got["grads"]) == set(ref["grads"])
        # a tied model has one embedding matrix; an untied one also a head
        assert ("lm_head.weight" in ref["grads"]) is not tie
        for name in sorted(ref["grads"]):
            r, g = ref["grads"][name], got["grads"][name]
            np.testing.assert_allclose(g, r, err_msg=f"seed {seed} {name}", **TOL)
            # gradients far below atol are checked against their own scale too (fp32 summation-order
            # noise grows with the gradient's magnitude, as in the torch-vs-transformers test)
            np.testing.assert_allclose(g, r, rtol=1.5e-4, atol=1e-3 * float(np.abs(r).max()),
                                       err_msg=f"seed {seed} {name} (scaled)")
        logit_abs, logit_share = worst(ref["logits"], got["logits"])
        grad_abs, grad_share, grad_name = max(
            (worst(ref["grads"][n], got["grads"][n]) + (n,) for n in ref["grads"]), key=lambda t: t[1]
        )
        scaled, scaled_name = max(
            (float(np.abs(got["grads"][n] - ref["grads"][n]).max() / np.abs(ref["grads"][n]).max()), n)
            for n in ref["grads"]
        )
        print(f"tie={tie} seed={seed}: logits max abs diff {logit_abs:.2e} ({logit_share:.2f} of tol), loss "
              f"{ref['loss']:.7f} vs {got['loss']:.7f}, {len(ref['grads'])} gradients: worst {grad_share:.2f} of tol "
              f"(abs {grad_abs:.2e}) at {grad_name}; worst max|diff|/max|grad| {scaled:.1e} at {scaled_name}")


def test_checkpoint_of_another_config_is_refused(references, tmp_path) -> None:
    from hp_dtensor.platform import current
    from hp_models.qwen3_5.mindspore import Qwen3_5ForCausalLM, load_hf_weights

    untied, tied = references[0, False][0], references[0, True][0]
    model = Qwen3_5ForCausalLM(config(False))
    before = {k: v.asnumpy().copy() for k, v in current().state_dict(model).items()}
    with pytest.raises(KeyError, match=r"missing \['lm_head.weight'\]"):
        load_hf_weights(model, tied)  # a tied checkpoint has no head for an untied model
    small = Qwen3_5ForCausalLM(config(False).replace(intermediate_size=512))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight.*\(768, 256\).*\(512, 256\)"):
        load_hf_weights(small, untied)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_weights(model, str(tmp_path / "missing"))
    for k, v in current().state_dict(model).items():
        np.testing.assert_array_equal(v.asnumpy(), before[k], err_msg=f"{k} changed by a refused load")
    from hp_models.qwen3_5.mindspore import check_tp_size_ms

    with pytest.raises(ValueError, match=r"tp=3 does not divide .*'num_attention_heads': 8"):
        check_tp_size_ms(config(False), 3)
    # a tied model reads the embedding once and its head is that very parameter
    tied_model = Qwen3_5ForCausalLM(config(True))
    keys = load_hf_weights(tied_model, tied)
    assert "lm_head.weight" not in keys and tied_model.lm_head.weight is tied_model.model.embed_tokens.weight


def test_init_weights_gives_the_torch_model_s_initial_values() -> None:
    import mindspore as ms

    from hp_models.qwen3_5.mindspore import Qwen3_5ForCausalLM

    ms.set_seed(0)
    model = Qwen3_5ForCausalLM(config(False))
    model.init_weights()
    mixer = model.model.layers[0].linear_attn
    a = np.exp(mixer.A_log.asnumpy())
    assert ((a >= 0.01) & (a <= 16.0)).all() and a.std() > 1.0  # A ~ U(0.01, 16)
    assert (mixer.dt_bias.asnumpy() == 1).all() and (mixer.norm.weight.asnumpy() == 1).all()
    assert (model.model.norm.weight.asnumpy() == 0).all()  # zero-centred: 1 + weight
    assert 0.015 < mixer.conv_q.asnumpy().std() < 0.025 and 0.015 < model.lm_head.weight.asnumpy().std() < 0.025
