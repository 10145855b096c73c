# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""``ExpertParallel`` on 2 and 4 real gloo ranks against one process holding every expert.

Seeded generated cases (batch sizes including a rank with no tokens, top-k, skewed routers that
send every token to one expert) check the MoE block's output, every gradient, exact token counts
(what each rank sends and receives sums to tokens x top_k), the all-to-alls each forward and
backward issues and their bytes.  The whole tiny MoE model is trained 3 AdamW steps at ep=2 and
ep=4 and must equal one process.  Bad configurations raise the same error on every rank, and so
do token counts that one rank's caller got wrong (checked after the count exchange).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from moe_cases import perturbed_model, seeded_block

from hp_dtensor.testing import rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)
pool4 = rank_pool_fixture(4, timeout=180)

RTOL, ATOL = 1.5e-4, 1e-5
LAYER_CASES = {2: 8, 4: 6}


def _block_config(case: random.Random):
    from hp_models.qwen3_5_moe import tiny_moe_config

    return tiny_moe_config(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=12,
        shared_expert_intermediate_size=8, num_experts=case.choice([4, 8]), num_experts_per_tok=case.choice([1, 2, 3]),
    )


def _layer_case(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    from hp_dtensor import CommDebugMode, DTensor, init_device_mesh
    from hp_ep import ExpertParallel
    from hp_ep.dispatch import COUNT_HEADER
    from hp_tp import parallelize_module

    case = random.Random(seed)
    cfg = _block_config(case)
    skew = case.random() < 0.3
    ref = seeded_block(cfg, seed, case, skew)
    block = copy.deepcopy(ref)
    # every rank draws every rank's batch (one of them may be empty)
    empty = case.randrange(world) if case.random() < 0.4 else -1
    xs = [torch.randn(0 if r == empty else case.choice([1, 2, 3]), case.choice([3, 5]), cfg.hidden_size) for r in range(world)]
    if skew:
        xs = [x.abs() for x in xs]
    gs = [torch.randn_like(x) for x in xs]
    ref_xs = [x.clone().requires_grad_() for x in xs]
    for x, g in zip(ref_xs, gs):
        (ref(x) * g).sum().backward()
    ref_outs = [ref(x).detach() for x in xs]

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    style = ExpertParallel()
    parallelize_module(block, mesh, {"experts": style})
    x = xs[rank].clone().requires_grad_()
    with CommDebugMode() as fwd:
        out = block(x)
    with CommDebugMode() as bwd:
        (out * gs[rank]).sum().backward()
    torch.testing.assert_close(out, ref_outs[rank], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad, ref_xs[rank].grad, rtol=RTOL, atol=ATOL)  # through both all-to-alls
    worst = (out - ref_outs[rank]).abs().max().item() if out.numel() else 0.0
    n_local = cfg.num_experts // world
    for name, p in block.named_parameters():
        ref_grad = dict(ref.named_parameters())[name].grad
        if isinstance(p, DTensor):  # an expert shard: every rank's tokens already contributed
            assert p.grad.placements == p.placements
            torch.testing.assert_close(p.grad.to_local(), ref_grad[rank * n_local:(rank + 1) * n_local], rtol=RTOL, atol=ATOL)
        else:  # dense (router, shared expert): data-parallel, summed over ranks
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)

    plan = style.plans[-1]
    tokens = xs[rank].shape[0] * xs[rank].shape[1]
    assert sum(plan.send_counts) == tokens * cfg.num_experts_per_tok
    sent = torch.tensor([sum(plan.send_counts), sum(plan.local_counts)])
    dist.all_reduce(sent)
    total_routed = sum(x.shape[0] * x.shape[1] for x in xs) * cfg.num_experts_per_tok
    assert sent.tolist() == [total_routed, total_routed]  # conserved: every routed copy is run once
    row = cfg.hidden_size * 4
    assert fwd.get_comm_counts() == {"all_to_all": 3}  # counts, dispatch, combine
    assert fwd.get_comm_bytes() == {
        "all_to_all": (cfg.num_experts + COUNT_HEADER * world) * 8 + sum(plan.send_counts) * row
        + sum(plan.recv_counts) * row
    }
    assert bwd.get_comm_counts() == {"all_to_all": 2}, bwd.get_comm_counts()  # the two reverses
    assert bwd.get_comm_bytes() == {"all_to_all": sum(plan.send_counts) * row + sum(plan.recv_counts) * row}
    return {"worst": worst, "skew": skew, "empty": empty >= 0, "received": sum(plan.recv_counts)}


def _nan_case(rank: int, world: int, seed: int, where: str) -> dict:
    """A router producing NaN propagates exactly as in one process: NaN rows route deterministically
    (``topk`` ranks NaN above every number), dispatch proceeds with the exchanged counts, and the
    output and gradients hold NaN in the same places as the reference; no rank errors or hangs."""
    import torch.distributed as dist

    from hp_dtensor import init_device_mesh
    from hp_ep import ExpertParallel
    from hp_models.qwen3_5_moe import SparseMoeBlock
    from hp_tp import parallelize_module

    case = random.Random(seed)
    cfg = _block_config(case)
    torch.manual_seed(seed)
    ref = SparseMoeBlock(cfg)
    xs = [torch.randn(2, 3, cfg.hidden_size) for _ in range(world)]
    with torch.no_grad():
        if where == "weights":  # one expert's router row is NaN: every token's probabilities are NaN
            ref.gate.weight[case.randrange(cfg.num_experts)] = float("nan")
        else:  # one token on rank 0 is NaN: only its routing and output are NaN
            xs[0][1, 2] = float("nan")
    block = copy.deepcopy(ref)
    ref_outs, ref_grads = [], []
    for x in xs:
        xr = x.clone().requires_grad_()
        out = ref(xr)
        out.sum().backward()
        ref_outs.append(out.detach())
        ref_grads.append(xr.grad)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    style = ExpertParallel()
    parallelize_module(block, mesh, {"experts": style})
    x = xs[rank].clone().requires_grad_()
    out = block(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref_outs[rank], rtol=RTOL, atol=ATOL, equal_nan=True)
    torch.testing.assert_close(x.grad, ref_grads[rank], rtol=RTOL, atol=ATOL, equal_nan=True)
    n_local = cfg.num_experts // world
    for name, p in block.named_parameters():
        if "experts." in name:
            want = dict(ref.named_parameters())[name].grad[rank * n_local:(rank + 1) * n_local]
            torch.testing.assert_close(p.grad.to_local(), want, rtol=RTOL, atol=ATOL, equal_nan=True)
    routed = torch.tensor([sum(style.plans[-1].send_counts)])
    dist.all_reduce(routed)
    assert routed.item() == world * 6 * cfg.num_experts_per_tok
    return {"nan_rows": int(out.isnan().any(-1).sum())}


def _model_case(rank: int, world: int, seed: int) -> float:
    """The tiny MoE model with every layer's experts over ep ranks, 3 AdamW steps, each rank its
    own batch; the reference is one process averaging the ranks' losses."""
    import torch.distributed as dist

    from hp_dtensor import DTensor, init_device_mesh
    from hp_ep import ExpertParallel
    from hp_models.qwen3_5_moe import tiny_moe_config
    from hp_tp import parallelize_module

    cfg = tiny_moe_config(vocab_size=64, hidden_size=32, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
                          moe_intermediate_size=16, shared_expert_intermediate_size=16, chunk_size=8,
                          router_aux_loss_coef=0.1)
    ref = perturbed_model(cfg, seed)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh, {"experts": ExpertParallel()})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(seed + 1)
    n_local = cfg.num_experts // world
    worst = 0.0
    for _ in range(3):
        batches = [torch.randint(0, cfg.vocab_size, (2, 12), generator=gen) for _ in range(world)]
        ref_loss = sum(ref.loss(ref(b), b) for b in batches) / world
        ref_loss.backward()
        loss = model.loss(model(batches[rank]), batches[rank])
        (loss / world).backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / world, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if isinstance(p, DTensor):
                torch.testing.assert_close(p.grad.to_local(), q.grad[rank * n_local:(rank + 1) * n_local],
                                           rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            else:
                dist.all_reduce(p.grad)  # data-parallel gradient sum of the dense parameters
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            mine = p.to_local() if isinstance(p, DTensor) else p
            want = q[rank * n_local:(rank + 1) * n_local] if isinstance(p, DTensor) else q
            torch.testing.assert_close(mine, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            worst = max(worst, (mine - want).abs().max().item())
    return worst


def _bad_inputs(rank: int, world: int) -> list[str]:
    from hp_dtensor import init_device_mesh
    from hp_ep import ExpertParallel
    from hp_models.qwen3_5_moe import SparseMoeBlock, tiny_moe_config
    from hp_protocols import JobConfig
    from hp_tp import parallelize_module

    messages = []
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    block = SparseMoeBlock(tiny_moe_config(num_experts=5, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=f"num_experts 5 is not divisible by the ep mesh size {world}") as e:
        parallelize_module(block, mesh, {"experts": ExpertParallel()})
    messages.append(str(e.value))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(top_k\) 9 must be between 1 and num_experts 8") as e:
        tiny_moe_config(num_experts_per_tok=9)
    messages.append(str(e.value))
    job: dict[str, dict[str, object]] = {"parallelism": {"tensor_parallel": 1, "expert_parallel": 3}}
    with pytest.raises(ValueError, match=r"expert_parallel 3 must divide dp_shard\*cp\*tp") as e:
        JobConfig.from_dict(job).resolve(world)
    messages.append(str(e.value))
    job = {"parallelism": {"expert_parallel": world, "moe_token_dispatcher_type": "alltoall_deredundancy",
                           "npu_nums_per_device": 8}}
    with pytest.raises(ValueError, match=rf"needs expert_parallel \({world}\) >= npu_nums_per_device \(8\)") as e:
        JobConfig.from_dict(job).resolve(world)
    messages.append(str(e.value))
    return messages


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_matches_one_process(world, pool2, pool4) -> None:
    pool = pool2 if world == 2 else pool4
    rng = random.Random(world)
    stats = [pool.run(_layer_case, rng.randrange(1 << 30))[0] for _ in range(LAYER_CASES[world])]
    assert any(s["skew"] for s in stats) and any(s["empty"] for s in stats)
    print(f"\nep={world}: {len(stats)} generated MoE-layer cases ({sum(s['skew'] for s in stats)} skewed to one "
          f"expert, {sum(s['empty'] for s in stats)} with a rank holding no tokens); worst |out diff| "
          f"{max(s['worst'] for s in stats):.2e}")


@pytest.mark.parametrize("world", [2, 4])
def test_model_three_adamw_steps_match_one_process(world, pool2, pool4) -> None:
    pool = pool2 if world == 2 else pool4
    worst = max(pool.run(_model_case, 7 + world))
    print(f"\nep={world}: tiny MoE model, 3 AdamW steps equal one process; worst |param diff| {worst:.2e}")


def test_router_nan_propagates_as_in_one_process(pool2) -> None:
    stats = {where: pool2.run(_nan_case, 5 + i, where) for i, where in enumerate(("token", "weights"))}
    assert sum(s["nan_rows"] for s in stats["token"]) == 1  # only the NaN token's output
    assert all(s["nan_rows"] == 6 for s in stats["weights"])  # every token on every rank
    print("\nrouter NaN: 2 cases (one NaN token, one NaN router row) propagate NaN exactly as one process")


def _bad_counts_case(rank: int, world: int, bad_rank: int, kind: str) -> str:
    """A hand-written caller passing counts that do not describe its tokens on ``bad_rank`` only:
    every rank raises the same ``ValueError`` (none waits in a collective), and the next good
    dispatch on the same group works."""
    from hp_dtensor import init_device_mesh
    from hp_ep import ExpertParallel
    from hp_models.qwen3_5_moe import GroupedExperts
    from hp_tp import parallelize_module

    experts, hidden = 2 * world, 4
    torch.manual_seed(0)
    module = GroupedExperts(experts, hidden, 6)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(module, mesh, ExpertParallel())
    x = torch.randn(experts, hidden)
    good = torch.ones(experts, dtype=torch.int64)
    bad = {"length": torch.ones(experts - 1, dtype=torch.int64),
           "sum": torch.full((experts,), 2, dtype=torch.int64),
           "negative": torch.tensor([2, -1] + [1] * (experts - 2), dtype=torch.int64)}[kind]
    with pytest.raises(ValueError, match=rf"ExpertParallel: ep rank {bad_rank} passed") as e:
        module(x, bad if rank == bad_rank else good)
    assert module(x, good).shape == x.shape  # the group is still in step
    return str(e.value)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_counts_on_one_rank_fail_every_rank(world, pool2, pool4) -> None:
    pool = pool2 if world == 2 else pool4
    cases = [(bad_rank, kind) for kind in ("length", "sum", "negative") for bad_rank in (0, world - 1)]
    words = {"length": f"for {2 * world - 1} experts, the module stacks {2 * world}",
             "sum": f"summing to {4 * world} for {2 * world} token rows", "negative": "1 negative token count(s)"}
    for bad_rank, kind in cases:
        messages = pool.run(_bad_counts_case, bad_rank, kind, timeout=60)  # a hang would fail here, not block
        assert all(m == messages[0] for m in messages) and words[kind] in messages[0], messages
    print(f"\nep={world}: {len(cases)} cases of bad counts on one rank (wrong length, wrong sum, negative): "
          f"every rank raised the same ValueError, and the group dispatched again")


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_same_error_on_every_rank(world, pool2, pool4) -> None:
    pool = pool2 if world == 2 else pool4
    messages = pool.run(_bad_inputs)
    assert all(m == messages[0] for m in messages)


def test_mindspore_is_refused_naming_the_feature(monkeypatch) -> None:
    import hp_dtensor.platform as platform
    from hp_dtensor.platform import package_backend

    monkeypatch.setattr(platform, "platform_name", lambda: "mindspore")  # as if MindSpore were selected
    package_backend.cache_clear()
    try:
        with pytest.raises(NotImplementedError, match=r"expert parallelism \(ExpertParallel\) is not supported on the "
                                                      r"mindspore backend yet"):
            from hp_ep.primitives import ep_primitives

            ep_primitives()
    finally:
        package_backend.cache_clear()
