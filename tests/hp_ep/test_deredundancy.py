# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The de-duplicating dispatcher (``alltoall_deredundancy``) on real gloo ranks against one process.

Nodes are groups of ``npu_nums_per_device`` consecutive ep ranks: ep=4 with nodes of 2 (two nodes)
and ep=2 with nodes of 2 (one node).  Seeded generated MoE-layer cases (top-k 1..4, skewed routers,
a rank without tokens) check the output, every gradient, token conservation, the all-to-alls and
their bytes, and the rows crossing nodes -- each computed here from the reference's routing, and
compared with plain all-to-all run on the same tokens: a token going to several experts on one
node crosses once.  The tiny Qwen3.5-MoE model under ``parallelize_qwen3_5_moe(dispatcher=...)``
(with TP, ep > tp and ep = tp) trains 3 AdamW steps equal to one process.  Bad node sizes raise
the same error on every rank.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from moe_cases import full_of, local_of, perturbed_model, seeded_block, tiny_model_config

from hp_dtensor.testing import rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)
pool4 = rank_pool_fixture(4, timeout=240)

RTOL, ATOL = 1.5e-4, 1e-5
LAYER_CASES = {2: 6, 4: 10}
INT, FLOAT = 8, 4  # bytes of a copy descriptor (int64) and of a routing weight / activation (fp32)


def _block_config(case: random.Random, every_expert: bool):
    """A random block; ``every_expert``: 4 experts, top-4 (each token goes to every expert)."""
    from hp_models.qwen3_5_moe import tiny_moe_config

    experts, top_k = case.choice([4, 8]), case.randint(1, 4)
    if every_expert:
        experts = top_k = 4
    return tiny_moe_config(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=12,
        shared_expert_intermediate_size=8, num_experts=experts, num_experts_per_tok=top_k,
    )


def _routing(block, x) -> list[list[int]]:
    """The experts each token of ``x`` is routed to, by the one-process block."""
    with torch.no_grad():
        _, _, ids = block.route(x.reshape(-1, x.shape[-1]))
    return ids.tolist()


def _expected(routes: list[list[list[int]]], rank: int, node_size: int, local: int) -> dict[str, int]:
    """What ``rank`` sends and receives under both dispatchers, from every rank's routing alone."""
    def node_of(e: int) -> int:
        return e // (node_size * local)

    world = len(routes)
    me_node, me_local = divmod(rank, node_size)
    peers = [s * node_size + me_local for s in range(world // node_size)]  # my outer group

    def unique_to(r: int, d: int) -> int:
        return sum(any(node_of(e) == d for e in tok) for tok in routes[r])

    def copies_to(r: int, d: int) -> int:
        return sum(node_of(e) == d for tok in routes[r] for e in tok)

    nodes = world // node_size
    return {
        "u_sent": sum(unique_to(rank, d) for d in range(nodes)),
        "c_sent": sum(len(tok) for tok in routes[rank]),
        "u_recv": sum(unique_to(p, me_node) for p in peers),
        "c_in": sum(copies_to(p, me_node) for p in peers),  # copies this rank hands on inside its node
        "c_mine": sum(e // local == rank for r in routes for tok in r for e in tok),  # copies run here
        "cross_rows": sum(unique_to(rank, d) for d in range(nodes) if d != me_node),
        "cross_copies": sum(copies_to(rank, d) for d in range(nodes) if d != me_node),
        "plain_cross_rows": sum(copies_to(rank, d) for d in range(nodes) if d != me_node),
    }


def _layer_case(rank: int, world: int, seed: int, node_size: int, every_expert: bool = False) -> dict:
    import torch.distributed as dist

    from hp_dtensor import CommDebugMode, DTensor, init_device_mesh
    from hp_ep import DeredundancyExpertParallel, ExpertParallel
    from hp_tp import parallelize_module

    case = random.Random(seed)
    cfg = _block_config(case, every_expert)
    skew = case.random() < 0.25 and not every_expert
    ref = seeded_block(cfg, seed, case, skew)
    ours, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    empty = case.randrange(world) if case.random() < 0.4 else -1
    xs = [torch.randn(0 if r == empty else case.choice([1, 2, 3]), case.choice([3, 5]), cfg.hidden_size)
          for r in range(world)]
    if skew:
        xs = [x.abs() for x in xs]
    gs = [torch.randn_like(x) for x in xs]
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_outs = []
    for x, g in zip(ref_xs, gs):
        out = ref(x)
        (out * g).sum().backward()
        ref_outs.append(out.detach())
    routes = [_routing(ref, x) for x in xs]

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    style = DeredundancyExpertParallel(node_size)
    parallelize_module(ours, mesh, {"experts": style})
    plain_style = ExpertParallel()
    parallelize_module(plain, mesh, {"experts": plain_style})
    x = xs[rank].clone().requires_grad_()
    with CommDebugMode() as fwd:
        out = ours(x)
    with CommDebugMode() as bwd:
        (out * gs[rank]).sum().backward()
    plain(xs[rank]).sum().backward()
    torch.testing.assert_close(out, ref_outs[rank], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad, ref_xs[rank].grad, rtol=RTOL, atol=ATOL)
    worst = (out - ref_outs[rank]).abs().max().item() if out.numel() else 0.0
    n_local = cfg.num_experts // world
    for name, p in ours.named_parameters():
        ref_grad = dict(ref.named_parameters())[name].grad
        if isinstance(p, DTensor):  # an expert shard: every rank's tokens already contributed
            torch.testing.assert_close(p.grad.to_local(), ref_grad[rank * n_local:(rank + 1) * n_local],
                                       rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        else:  # router (through the routing weights sent across nodes) and shared expert
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")

    want = _expected(routes, rank, node_size, n_local)
    plan = style.plans[-1]
    row = cfg.hidden_size * FLOAT
    nodes, node_experts = world // node_size, node_size * n_local
    # conserved: every routed copy leaves its rank once and runs once, over all ranks
    routed = torch.tensor([sum(plan.send_counts), sum(plan.local_counts)])
    dist.all_reduce(routed)
    total = sum(len(r) for r in routes) * cfg.num_experts_per_tok
    assert routed.tolist() == [total, total], routed.tolist()
    assert (plan.cross_node_rows, plan.cross_node_copies) == (want["cross_rows"], want["cross_copies"])
    assert sum(plan.local_counts) == want["c_mine"]
    # forward: outer counts, token rows, weights, descriptors; inner counts, copies, combine; rows back
    assert fwd.get_comm_counts() == {"all_to_all": 8}, fwd.get_comm_counts()
    assert fwd.get_comm_bytes()["all_to_all"] == (
        2 * nodes * INT + want["c_sent"] * (FLOAT + INT) + node_experts * INT
        + (want["u_sent"] + want["c_in"] + want["c_mine"] + want["u_recv"]) * row
    )
    # backward: the five differentiable exchanges in reverse (descriptors carry no gradient)
    assert bwd.get_comm_counts() == {"all_to_all": 5}, bwd.get_comm_counts()
    assert bwd.get_comm_bytes()["all_to_all"] == (
        (want["u_sent"] + want["c_in"] + want["c_mine"] + want["u_recv"]) * row + want["c_in"] * FLOAT
    )
    # plain all-to-all on the same tokens: one row per copy crosses, there and back
    plain_plan = plain_style.plans[-1]
    me_node = rank // node_size
    plain_cross = sum(c for g, c in enumerate(plain_plan.send_counts) if g // node_experts != me_node)
    assert plain_cross == want["plain_cross_rows"]
    ours_bytes = 2 * want["cross_rows"] * row + want["cross_copies"] * (FLOAT + INT) + 2 * (nodes - 1) * INT
    plain_bytes = 2 * plain_cross * row + n_local * (world - node_size) * INT
    return {"worst": worst, "skew": skew, "empty": empty >= 0, "ours_cross": ours_bytes, "plain_cross": plain_bytes,
            "cross_rows": want["cross_rows"], "cross_copies": want["cross_copies"]}


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_matches_one_process_and_moves_fewer_rows_across_nodes(world, pool2, pool4) -> None:
    pool = pool2 if world == 2 else pool4
    rng = random.Random(100 + world)
    seeds = [rng.randrange(1 << 30) for _ in range(LAYER_CASES[world])]
    cases = [pool.run(_layer_case, seed, 2, i == 0) for i, seed in enumerate(seeds)]
    stats = [s for results in cases for s in results]
    assert any(s["skew"] for s in stats) and any(s["empty"] for s in stats)
    ours, plain = sum(s["ours_cross"] for s in stats), sum(s["plain_cross"] for s in stats)
    # a rank whose tokens each reach a remote node with at least two copies saves a row per extra copy
    dense = [s for s in stats if s["cross_copies"] >= 2 * s["cross_rows"] > 0]
    assert all(s["ours_cross"] < s["plain_cross"] for s in dense)
    if world == 4:  # two nodes: the forced top-4 of 4 experts case puts two copies of every token on each node
        assert len(dense) >= world and ours < plain
    print(f"\nalltoall_deredundancy ep={world}, nodes of 2: {len(cases)} generated MoE-layer cases "
          f"({sum(s['skew'] for s in stats) // world} skewed, {sum(s['empty'] for s in stats) // world} with a rank "
          f"holding no tokens) equal one process; worst |out diff| {max(s['worst'] for s in stats):.2e}; bytes across "
          f"nodes over all cases {ours} vs plain all-to-all {plain}")


def _model_case(rank: int, world: int, tp: int, ep: int, seed: int) -> dict:
    """The tiny MoE model (top-4 of 8) under the composed plan with the de-duplicating dispatcher,
    nodes of 2 ep ranks; 3 AdamW steps against one process averaging the data-parallel batches."""
    import torch.distributed as dist

    from hp_dtensor import CommDebugMode
    from hp_ep import DeredundancyExpertParallel, TokenDispatcher
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe
    from hp_protocols import JobConfig

    dims = JobConfig.from_dict({"parallelism": {"tensor_parallel": tp, "expert_parallel": ep}}).resolve(world)
    dense, sparse = dims.build_mesh("cpu")
    dp_group, efsdp_group = dense["fsdp"].get_group(0), sparse["efsdp"].get_group(0)
    dp_rank = dense["fsdp"].get_local_rank(0)
    cfg = tiny_model_config(num_experts_per_tok=4)
    ref = perturbed_model(cfg, seed)
    model = copy.deepcopy(ref)
    styles = parallelize_qwen3_5_moe(model, tp_mesh=dense["tp"], ep_mesh=sparse["ep"],
                                     dispatcher=TokenDispatcher.ALLTOALL_DEREDUNDANCY, npu_nums_per_device=2)
    assert len(styles) == cfg.num_hidden_layers and all(isinstance(s, DeredundancyExpertParallel) for s in styles)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(seed + 1)
    seq, batch = 12, 2
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "cross": 0, "copies": 0}
    for step in range(3):
        batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen) for _ in range(dims.dp_shard)]
        ref_loss = sum(ref.loss(ref(b), b) for b in batches) / dims.dp_shard
        ref_loss.backward()
        for s in styles:
            s.clear_plans()
        mine = batches[dp_rank]
        with CommDebugMode() as fwd:
            loss = model.loss(model(mine), mine)
        with CommDebugMode() as bwd:
            (loss / dims.dp_shard).backward()
        layers = len(styles)
        assert fwd.get_comm_counts()["all_to_all"] == 8 * layers, fwd.get_comm_counts()
        assert bwd.get_comm_counts()["all_to_all"] == 5 * layers, bwd.get_comm_counts()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        torch.testing.assert_close(total / dims.dp_shard, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        worst["loss"] = max(worst["loss"], abs((total / dims.dp_shard - ref_loss).item()))
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            dist.all_reduce(local_of(p.grad), group=efsdp_group if "experts" in name else dp_group)
            g = full_of(p.grad)
            torch.testing.assert_close(g, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            worst["grad"] = max(worst["grad"], (g - q.grad).abs().max().item())
        # conserved: every layer runs each token copy once, over all ranks
        routed = torch.tensor([[sum(s.plans[-1].send_counts), sum(s.plans[-1].local_counts)] for s in styles])
        dist.all_reduce(routed)
        want = batch * seq * dims.dp_shard * cfg.num_experts_per_tok
        assert routed.tolist() == [[want, want]] * layers, routed.tolist()
        if step == 0:
            worst["cross"] = sum(s.plans[-1].cross_node_rows for s in styles)
            worst["copies"] = sum(s.plans[-1].cross_node_copies for s in styles)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            full = full_of(p)
            torch.testing.assert_close(full, q, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            worst["param"] = max(worst["param"], (full - q).abs().max().item())
    return worst


@pytest.mark.parametrize("tp,ep", [(2, 4), (2, 2)], ids=["ep4_tp2_nodes2", "ep2xtp2_nodes2"])
def test_model_three_adamw_steps_match_one_process(tp: int, ep: int, pool4) -> None:
    results = pool4.run(_model_case, tp, ep, 31)
    if ep == 4:  # two nodes: copies sharing a remote node crossed as one row
        assert sum(r["cross"] for r in results) < sum(r["copies"] for r in results)
    print(f"\nalltoall_deredundancy ep={ep} (nodes of 2) x tp={tp}, tiny MoE top-4 of 8: 3 AdamW steps equal one "
          f"process; worst |loss diff| {max(r['loss'] for r in results):.2e}, |grad diff| "
          f"{max(r['grad'] for r in results):.2e}, |param diff| {max(r['param'] for r in results):.2e}; rows across "
          f"nodes in step 1 {sum(r['cross'] for r in results)} for {sum(r['copies'] for r in results)} copies")


def _bad_inputs(rank: int, world: int) -> list[str]:
    from hp_dtensor import init_device_mesh
    from hp_ep import DeredundancyExpertParallel, TokenDispatcher, make_expert_parallel
    from hp_models.qwen3_5_moe import Qwen3_5MoeForCausalLM, SparseMoeBlock, tiny_moe_config
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe
    from hp_tp import parallelize_module

    messages = []
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    cfg = tiny_moe_config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
                          num_hidden_layers=1, layer_types=["full_attention"])
    model = Qwen3_5MoeForCausalLM(cfg)
    with pytest.raises(ValueError, match=rf"alltoall_deredundancy needs expert_parallel \({world}\) >= "
                                         rf"npu_nums_per_device \(8\)") as e:
        parallelize_qwen3_5_moe(model, ep_mesh=mesh, dispatcher=TokenDispatcher.ALLTOALL_DEREDUNDANCY,
                                npu_nums_per_device=8)
    messages.append(str(e.value))
    if world == 4:
        with pytest.raises(ValueError, match=r"expert_parallel \(4\) to be a multiple of npu_nums_per_device \(3\)"):
            parallelize_module(SparseMoeBlock(cfg), mesh, {"experts": DeredundancyExpertParallel(3)})
    with pytest.raises(ValueError, match=r"npu_nums_per_device must be >= 1, got 0"):
        parallelize_module(SparseMoeBlock(cfg), mesh, {"experts": DeredundancyExpertParallel(0)})
    block = SparseMoeBlock(cfg)
    parallelize_module(block, mesh, {"experts": DeredundancyExpertParallel(2)})
    with pytest.raises(ValueError, match=r"must be called per token, \(x, counts, token_index, weights\)") as e:
        block.experts(torch.randn(3, 16), torch.tensor([3, 0, 0, 0]))
    messages.append(str(e.value))
    with pytest.raises(TypeError, match="dispatcher must be a TokenDispatcher, got 'alltoall_deredundancy'"):
        make_expert_parallel("alltoall_deredundancy")
    with pytest.raises(ValueError, match=r"moe_token_dispatcher_type must be one of \['alltoall', "
                                         r"'alltoall_deredundancy'\], got 'deredundancy'"):
        TokenDispatcher.from_name("deredundancy")
    assert TokenDispatcher.from_name("alltoall_deredundancy") is TokenDispatcher.ALLTOALL_DEREDUNDANCY
    return messages


@pytest.mark.parametrize("world", [2, 4])
def test_bad_node_sizes_same_error_on_every_rank(world, pool2, pool4) -> None:
    pool = pool2 if world == 2 else pool4
    messages = pool.run(_bad_inputs)
    assert all(m == messages[0] for m in messages)
    print(f"\nep={world}: bad node sizes and calls refused with the same message on all {world} ranks: {messages[0][0]}")
