# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""ExpertTensorParallel on 4 real gloo ranks against one process: with ``ep < tp`` the experts keep
a TP split over the ``etp = tp // ep`` TP ranks sharing an ep coordinate (gate/up by column, down
by row), so a rank holds 1 / (ep * etp) of them.

Layouts: tp=4 with ep=2 (etp=2) and tp=2 with ep=1 (etp=2, two data-parallel replicas).  Each
seeded case checks the loss (LM + aux), every gradient and 3 AdamW steps of the tiny MoE model
against one process averaging the data-parallel batches, the expert share per rank, token
conservation, and the all-to-alls each MoE layer issues.
"""

from __future__ import annotations

import copy

import pytest
import torch
from moe_cases import full_of, local_of, perturbed_model, tiny_model_config

from hp_dtensor.testing import rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)

RTOL, ATOL = 1.5e-4, 1e-5


def _etp_case(rank: int, world: int, tp: int, ep: int, seed: int) -> dict:
    import torch.distributed as dist

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_ep import ExpertTensorParallel
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe

    dp, etp = world // tp, tp // ep
    dense = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("fsdp", "tp"))
    # the sparse ranks with the TP part of efsdp named: ep innermost, then the etp ranks of one TP group
    sparse = init_device_mesh("cpu", (dp, etp, ep), mesh_dim_names=("edp", "etp", "ep"))
    dp_group, edp_group, dp_rank = dense["fsdp"].get_group(0), sparse["edp"].get_group(0), dense.get_local_rank(0)
    cfg = tiny_model_config()
    ref = perturbed_model(cfg, seed)
    model = copy.deepcopy(ref)
    styles = parallelize_qwen3_5_moe(model, tp_mesh=dense["tp"], ep_mesh=sparse["ep"], etp_mesh=sparse["etp"])
    assert len(styles) == cfg.num_hidden_layers and all(isinstance(s, ExpertTensorParallel) for s in styles)
    # eps 1e-6: at tp=4 a few dense gradients are ~1e-8, where AdamW's default eps would turn fp32
    # rounding in the gradient into a full-size update
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=True)
    gen = torch.Generator().manual_seed(seed + 1)
    seq, batch = 12, 2
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for _ in range(3):
        batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen) for _ in range(dp)]
        ref_loss = sum(ref.loss(ref(b), b) for b in batches) / dp
        ref_loss.backward()
        for s in styles:
            s.clear_plans()
        mine = batches[dp_rank]
        with CommDebugMode() as fwd:
            loss = model.loss(model(mine), mine)
        with CommDebugMode() as bwd:
            (loss / dp).backward()
        layers = len(styles)  # per layer: ep counts, dispatch, combine + etp counts, pool, reduce-scatter
        assert fwd.get_comm_counts()["all_to_all"] == 6 * layers, fwd.get_comm_counts()
        assert bwd.get_comm_counts()["all_to_all"] == 4 * layers, bwd.get_comm_counts()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        torch.testing.assert_close(total / dp, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        worst["loss"] = max(worst["loss"], abs((total / dp - ref_loss).item()))
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            # data-parallel sum: experts over the replicas of their (ep, etp) shard, the rest over fsdp
            dist.all_reduce(local_of(p.grad), group=edp_group if "experts" in name else dp_group)
            g = full_of(p.grad)
            torch.testing.assert_close(g, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            worst["grad"] = max(worst["grad"], (g - q.grad).abs().max().item())
        routed = torch.tensor([[sum(s.plans[-1].send_counts), sum(s.plans[-1].local_counts)] for s in styles])
        dist.all_reduce(routed)  # every copy dispatched once over ep (the etp ranks pool, not re-dispatch)
        want = batch * seq * dp * cfg.num_experts_per_tok
        assert routed.tolist() == [[want, want]] * layers, routed.tolist()
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            full = full_of(p)
            torch.testing.assert_close(full, q, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            worst["param"] = max(worst["param"], (full - q).abs().max().item())
    held = sum(local_of(p).numel() for n, p in model.named_parameters() if "experts" in n)
    worst["expert_share"] = held / sum(q.numel() for n, q in ref.named_parameters() if "experts" in n)
    return worst


@pytest.mark.parametrize("tp,ep", [(4, 2), (2, 1)], ids=["tp4_ep2_etp2", "tp2_ep1_etp2_dp2"])
def test_expert_tensor_parallel_three_adamw_steps_match_one_process(tp: int, ep: int, pool4) -> None:
    seeds = [41 + tp]
    results = [r for seed in seeds for r in pool4.run(_etp_case, tp, ep, seed)]
    etp = tp // ep
    assert all(r["expert_share"] == 1 / (ep * etp) for r in results)
    print(f"\nExpertTensorParallel ep={ep} x etp={etp} (tp={tp}) on 4 ranks: {len(seeds)} seeded cases x 3 AdamW "
          f"steps equal one process; worst |loss diff| {max(r['loss'] for r in results):.2e}, |grad diff| "
          f"{max(r['grad'] for r in results):.2e}, |param diff| {max(r['param'] for r in results):.2e}; experts "
          f"per rank 1/{ep * etp}")


def _bad_inputs(rank: int, world: int) -> list[str]:
    from hp_dtensor import init_device_mesh
    from hp_ep import ExpertTensorParallel, TokenDispatcher, ep_etp_mesh
    from hp_models.qwen3_5_moe import Qwen3_5MoeForCausalLM, SparseMoeBlock
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe

    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("etp", "ep"))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("etp",))
    messages = []
    with pytest.raises(ValueError, match="needs an ep_mesh from the same mesh .* and the alltoall dispatcher") as e:
        parallelize_qwen3_5_moe(Qwen3_5MoeForCausalLM(tiny_model_config()), ep_mesh=sparse["ep"], etp_mesh=sparse["etp"],
                                dispatcher=TokenDispatcher.ALLTOALL_DEREDUNDANCY, npu_nums_per_device=2)
    messages.append(str(e.value))
    with pytest.raises(ValueError, match="ep_etp_mesh needs two 1-D dims sliced by name from one mesh"):
        ep_etp_mesh(sparse["ep"], other["etp"])
    with pytest.raises(ValueError, match=r"needs a 2-D \(ep, etp\) mesh with dim names, got 1 dims"):
        ExpertTensorParallel().apply(SparseMoeBlock(tiny_model_config()).experts, sparse["ep"])
    with pytest.raises(ValueError, match=r"holds parameters \['down_proj', 'gate_proj', 'up_proj'\], the style "
                                         r"splits columns of \['w1', 'w3'\] and rows of \['w2'\]"):
        ExpertTensorParallel(column=("w1", "w3"), row=("w2",)).apply(SparseMoeBlock(tiny_model_config()).experts,
                                                                     ep_etp_mesh(sparse["ep"], sparse["etp"]))
    return messages


def test_bad_expert_tensor_parallel_setups_same_error_on_every_rank(pool4) -> None:
    messages = pool4.run(_bad_inputs)
    assert all(m == messages[0] for m in messages)
    print(f"\nExpertTensorParallel: 4 bad setups refused on all 4 ranks, e.g. {messages[0][0]}")
