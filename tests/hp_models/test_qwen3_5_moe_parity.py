# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive HF and torch modules through untyped APIs)
"""One process: the MoE model against transformers' ``Qwen3_5MoeForCausalLM``.

Each seeded generated case builds a HF model from a random small config, writes it with
``save_pretrained`` (per-expert tensors on disk) and loads it with our adapter.  Logits, the loss
with the router's load-balancing term, every gradient and the set of experts each token is
routed to must match.  Global-shape checks, the adapter's round trip and the config are tested too.
"""

from __future__ import annotations

import random

import pytest
import torch

from hp_models.qwen3_5_moe import (
    MODEL_SPEC,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeStateDictAdapter,
    tiny_moe_config,
)

CASES = 6


def _case_config(rng: random.Random) -> Qwen3_5MoeConfig:
    experts = rng.choice([4, 8])
    layers = rng.choice([2, 4])
    return tiny_moe_config(
        vocab_size=96, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, chunk_size=8, moe_intermediate_size=rng.choice([16, 24]),
        shared_expert_intermediate_size=rng.choice([16, 40]), num_experts=experts,
        num_experts_per_tok=rng.choice([1, 2, 3]), full_attention_interval=2, layer_types=None,
        router_aux_loss_coef=rng.choice([0.001, 0.1]), tie_word_embeddings=rng.random() < 0.3,
    )


def _hf_grads_per_expert(hf) -> dict[str, torch.Tensor]:
    """HF's in-memory gradients in its on-disk layout (fused ``gate_up_proj`` split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            for e in range(p.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = p.grad[e]
        else:
            out[name] = p.grad
    return out


def test_model_matches_transformers_on_generated_cases(tmp_path) -> None:
    from transformers import Qwen3_5MoeForCausalLM as HF
    from transformers import Qwen3_5MoeTextConfig

    rng = random.Random(2028)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
    routed_tokens = 0
    for case in range(CASES):
        cfg = _case_config(rng)
        torch.manual_seed(case)
        hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "model_type"})
        hf = HF(hf_cfg)
        with torch.no_grad():  # HF zero-inits norms and the router; perturb so every path matters
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        hf.save_pretrained(tmp_path / f"c{case}")
        ours = Qwen3_5MoeForCausalLM(cfg)
        read = Qwen3_5MoeStateDictAdapter(cfg).load_into(ours, str(tmp_path / f"c{case}"))
        assert any(".experts.0.gate_proj.weight" in n for n in read)

        ids = torch.randint(0, cfg.vocab_size, (rng.choice([1, 2]), rng.choice([7, 13, 19])))
        labels = ids.clone()
        # the experts HF routes each token to, captured at its router
        hf_routes: list[torch.Tensor] = []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda m, i, o, routes=hf_routes: routes.append(o[2]))
            for layer in hf.model.layers
        ]
        out = hf(ids, labels=labels, output_router_logits=True)
        for h in hooks:
            h.remove()
        logits = ours(ids)
        loss = ours.loss(logits, labels)
        worst["logits"] = max(worst["logits"], (logits - out.logits).abs().max().item())
        worst["loss"] = max(worst["loss"], abs(loss.item() - out.loss.item()))
        torch.testing.assert_close(logits, out.logits, rtol=1.5e-4, atol=1e-5)
        torch.testing.assert_close(ours.aux_loss(), out.aux_loss, rtol=1.5e-4, atol=1e-6)
        torch.testing.assert_close(loss, out.loss, rtol=1.5e-4, atol=1e-5)
        for block, hf_ids in zip(ours.moe_blocks(), hf_routes):
            ours_sets = [set(r) for r in block.router_topk.tolist()]
            assert ours_sets == [set(r) for r in hf_ids.tolist()]
            routed_tokens += len(ours_sets)

        loss.backward()
        out.loss.backward()
        adapter = Qwen3_5MoeStateDictAdapter(cfg)
        hf_grads = adapter.from_hf(_hf_grads_per_expert(hf))
        for name, p in ours.named_parameters():
            ref = hf_grads[name]
            atol = max(1e-6, 1e-3 * ref.abs().max().item())
            worst["grad"] = max(worst["grad"], ((p.grad - ref).abs().max() / (ref.abs().max() + 1e-12)).item())
            torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=atol, msg=lambda m, n=name, c=case: f"case {c} {n}: {m}")
    print(f"\n{CASES} generated cases, {routed_tokens} token routings equal as sets; worst |logits diff| "
          f"{worst['logits']:.2e}, |loss diff| {worst['loss']:.2e}, grad diff / max|grad| {worst['grad']:.2e}")


def test_adapter_round_trip_and_global_shape_check(tmp_path) -> None:
    from safetensors.torch import save_file

    cfg = tiny_moe_config(vocab_size=64, hidden_size=32, num_hidden_layers=2, full_attention_interval=2,
                          layer_types=None, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                          head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg)
    adapter = Qwen3_5MoeStateDictAdapter(cfg)
    hf = adapter.to_hf(model.state_dict())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf
    assert not any(k.endswith("experts.gate_proj") for k in hf)
    back = adapter.from_hf(hf)
    assert back.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))
    fresh = Qwen3_5MoeForCausalLM(cfg)
    adapter.load_into(fresh, str(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # a checkpoint of another expert size is refused naming the tensor, before anything is read
    bigger = Qwen3_5MoeForCausalLM(cfg.replace(moe_intermediate_size=24))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight.*global shape \(16, 32\).*expects \(24, 32\)"):
        Qwen3_5MoeStateDictAdapter(bigger.config).load_into(bigger, str(tmp_path))
    # a checkpoint with fewer experts than the config: refused at the router, naming both shapes
    more = Qwen3_5MoeForCausalLM(cfg.replace(num_experts=9))
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight.*global shape \(8, 32\).*expects \(9, 32\)"):
        Qwen3_5MoeStateDictAdapter(more.config).load_into(more, str(tmp_path))


def test_config_and_spec(tmp_path) -> None:
    import json

    tiny = tiny_moe_config()
    assert (tiny.num_experts, tiny.num_experts_per_tok, tiny.num_hidden_layers) == (8, 2, 4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": tiny.to_hf_dict()}))
    assert Qwen3_5MoeConfig.from_json_file(str(path)) == tiny.replace(chunk_size=64, intermediate_size=12288)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(top_k\) 9 .* num_experts 8"):
        tiny_moe_config(num_experts_per_tok=9)
    model = MODEL_SPEC.build()
    model.verify_module_protocol()
    n, flops = model.get_nparams_and_flops(64)
    assert n > 0 and flops > 0
