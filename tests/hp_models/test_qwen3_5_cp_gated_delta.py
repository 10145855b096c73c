# mypy: disable-error-code="no-untyped-def,no-any-return"
"""A Gated DeltaNet layer under context parallelism (cp = 2 and 4 on 4 gloo ranks, the
load-balanced split) against the same layer on the whole sequence in one process: outputs, the
input's gradient and every parameter's gradient, with and without packed documents crossing the
rank boundaries (the one-process reference then runs each document alone); one all-gather for
the convolution halo and one for the chunk states forward, their duals backward."""

from __future__ import annotations

import random

import torch

from hp_cp import ContextParallel, ContextParallelConfig, MaskCompression
from hp_dtensor import CommDebugMode, init_device_mesh
from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models.qwen3_5 import tiny_config
from hp_models.qwen3_5.context_parallel import gated_delta_net_cp
from hp_models.qwen3_5.model import GatedDeltaNet

pool4 = rank_pool_fixture(4, timeout=180)


def _documents(rng: random.Random, seq: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq), rng.randint(1, 4)))
    return [*cuts, seq]


def run_case(rank: int, world: int, cp_degree: int, chunk: int, eod: bool, batch: int, seed: int) -> dict:
    torch.manual_seed(seed)
    cfg = tiny_config(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, chunk_size=4)
    layer = GatedDeltaNet(cfg).double()
    seq = 2 * cp_degree * chunk
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=torch.float64)
    dout = torch.randn(batch, seq, cfg.hidden_size, dtype=torch.float64)
    rng = random.Random(seed)
    actual = [_documents(rng, seq) for _ in range(batch)] if eod else None

    # the reference: the whole sequence in one process, each document alone
    xr = x.clone().requires_grad_(True)
    if actual is None:
        ref = layer(xr)
    else:
        rows = []
        for r, ends in enumerate(actual):
            starts = [0, *ends[:-1]]
            rows.append(torch.cat([layer(xr[r:r + 1, a:e]) for a, e in zip(starts, ends)], dim=1))
        ref = torch.cat(rows)
    ref.backward(dout)
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    if cp_degree == world:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    else:
        mesh = init_device_mesh("cpu", (world // cp_degree, cp_degree), mesh_dim_names=("dp", "cp"))["cp"]
    cp = ContextParallel(mesh, ContextParallelConfig(
        degree=cp_degree, compression=MaskCompression.EOD if eod else MaskCompression.CAUSAL))
    xl = cp.split(x, dim=1).requires_grad_(True)
    with CommDebugMode() as fwd:
        out = gated_delta_net_cp(layer, xl, cp, seq, actual)
    with CommDebugMode() as bwd:
        out.backward(cp.split(dout, dim=1))
    # parameter gradients are partial per rank: sum them over the CP group
    group = mesh.get_group(0)
    def rel(got, want):
        return float(((got - want).abs() / (want.abs() + 1.0)).max())

    errs = {"out": rel(out.detach(), cp.split(ref.detach(), dim=1)), "dx": rel(xl.grad, cp.split(xr.grad, dim=1))}
    for n, p in layer.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        errs[n] = rel(grad, ref_grads[n])
    return {"errs": errs, "fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts()}


def test_gated_delta_net_under_cp_equals_one_process(pool4: RankPool) -> None:
    rng = random.Random(2703)
    cases = []
    for i in range(12):
        cases.append((rng.choice([2, 4]), rng.choice([3, 5, 6, 9]), i % 2 == 1, rng.choice([1, 2]),
                      rng.randrange(1 << 30)))
    worst = 0.0
    for case in cases:
        for r in pool4.run(run_case, *case):
            for name, err in r["errs"].items():
                # a float64 layer computes the delta rule in float64 in both
                assert err < 1e-10, (case, name, err)
                worst = max(worst, err)
            assert r["fwd"] == {"all_gather": 2}, (case, r["fwd"])
            assert r["bwd"] == {"reduce_scatter": 2}, (case, r["bwd"])
    print(f"Gated DeltaNet under CP: {len(cases)} generated cases ({sum(c[2] for c in cases)} with packed "
          f"documents crossing rank boundaries, {sum(c[0] == 4 for c in cases)} at cp=4), worst relative "
          f"difference {worst:.2e}")
