# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""One process: the model against transformers' qwen3_5 (same tiny config and weights), the
chunked recurrence against its step-by-step definition, configs and the model spec."""

from __future__ import annotations

import json

import pytest
import torch

from hp_models.qwen3_5 import MODEL_SPEC, Qwen3_5Config, Qwen3_5StateDictAdapter, tiny_config
from hp_models.qwen3_5.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _perturbed(cfg: Qwen3_5Config):
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # non-trivial norms and gates
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_logits_and_every_gradient_match_transformers(tie: bool) -> None:
    from transformers import Qwen3_5ForCausalLM as HF
    from transformers import Qwen3_5TextConfig

    cfg = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, chunk_size=8, tie_word_embeddings=tie)
    ours = _perturbed(cfg)
    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "model_type"})
    hf = HF(hf_cfg)
    adapter = Qwen3_5StateDictAdapter(cfg)
    hf.load_state_dict(adapter.to_hf(ours.state_dict()), strict=not tie)
    ids = torch.randint(0, 128, (2, 19))  # not a multiple of the chunk size
    ours_logits, hf_logits = ours(ids), hf(ids).logits
    torch.testing.assert_close(ours_logits, hf_logits, rtol=1.5e-4, atol=1e-5)
    g = torch.randn_like(hf_logits)
    (ours_logits * g).sum().backward()
    (hf_logits * g).sum().backward()
    hf_grads = adapter.from_hf({k: p.grad for k, p in hf.named_parameters()})
    for name, p in ours.named_parameters():
        # fp32 accumulation-order noise scales with the gradient's magnitude
        atol = max(1e-5, 1e-3 * hf_grads[name].abs().max().item())
        torch.testing.assert_close(p.grad, hf_grads[name], rtol=1e-3, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_rule_equals_recurrence() -> None:
    torch.manual_seed(1)
    q, k = torch.randn(2, 37, 2, 8), torch.randn(2, 37, 2, 8)
    v = torch.randn(2, 37, 4, 8)
    g, beta = -torch.rand(2, 37, 4), torch.rand(2, 37, 4)
    for chunk in (4, 16, 64):
        torch.testing.assert_close(
            chunk_gated_delta_rule(q, k, v, g, beta, chunk), recurrent_gated_delta_rule(q, k, v, g, beta),
            rtol=1e-5, atol=1e-5,
        )


def test_configs(tmp_path) -> None:
    tiny = tiny_config()
    assert tiny.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    n = sum(p.numel() for p in tiny.build().parameters())
    assert 2_000_000 < n < 8_000_000
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_5", "text_config": tiny.to_hf_dict()}))
    loaded = Qwen3_5Config.from_json_file(str(path))
    assert loaded == tiny.replace(chunk_size=64)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Qwen3_5Config.from_json_file(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny_config(num_attention_heads=6, num_key_value_heads=4)


def test_registered_model_spec_builds_the_model() -> None:
    from hp_protocols import get_model_spec

    spec = get_model_spec("qwen3_5")
    assert spec is MODEL_SPEC
    model = spec.build()
    model.verify_module_protocol()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
