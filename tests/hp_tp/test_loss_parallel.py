# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""``loss_parallel`` against plain ``F.cross_entropy`` in float64 on one process, over seeded
generated cases of its whole argument surface (input rank, uneven vocab down to ranks holding no
class, the vocab on the second dim of a 2-D mesh, class-index and
probability targets, ``weight``, ``ignore_index``, ``label_smoothing``, every ``reduction``):
values and gradients, on 2 and 4 gloo ranks.  Collectives are counted: two all_reduce in forward,
none in backward, no more than torch's own ``loss_parallel``.  Bad arguments raise torch's error on
every rank."""

from __future__ import annotations

import random
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, outcomes, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=240)
pool4 = rank_pool_fixture(4, timeout=240)

CASES = 60


def _case(seed: int, world: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ndim = rng.choice([1, 2, 2, 3, 4])
    # even splits, uneven ones, and fewer classes than ranks (torch.chunk leaves the last ranks empty)
    classes = world * rng.randint(1, 5) if rng.random() < 0.5 else rng.randint(1, 3 * world)
    batch = [rng.randint(1, 5) for _ in range(max(ndim - 1, 0))]
    shape = [classes] if ndim == 1 else [batch[0], classes, *batch[1:]]
    return {
        "shape": shape,
        "prob": rng.random() < 0.2,
        "weight": rng.random() < 0.5,
        "ignore": rng.choice([-100, -100, rng.randrange(classes)]),
        "smoothing": rng.choice([0.0, 0.0, rng.uniform(0.0, 1.0), 1.0]),
        "reduction": rng.choice(["none", "sum", "mean"]),
        "noncontig": rng.random() < 0.3,
        "mesh2d": world == 4 and rng.random() < 0.3,
    }


def _run_cases(rank: int, world: int, n: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, Replicate, Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")) if world == 4 else None
    fwd_counts, bwd_counts = set(), set()
    kinds = {"prob": 0, "weight": 0, "smoothing": 0, "ignored": 0, "uneven": 0, "empty_rank": 0, "mesh2d": 0}
    for seed in range(n):
        c = _case(seed, world)
        g = torch.Generator().manual_seed(seed)
        shape = c["shape"]
        cdim = 0 if len(shape) == 1 else 1
        x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
        batch = [s for i, s in enumerate(shape) if i != cdim]
        if c["prob"]:
            target = torch.rand(*shape, generator=g, dtype=torch.float64).softmax(cdim)
        else:
            target = torch.randint(0, shape[cdim], batch, generator=g)
            if target.numel() and c["ignore"] >= 0:
                target.view(-1)[0] = c["ignore"]
            elif target.numel() > 1:
                target.view(-1)[1] = -100
        kw: dict[str, Any] = {"reduction": c["reduction"], "label_smoothing": c["smoothing"]}
        if not c["prob"]:
            kw["ignore_index"] = c["ignore"]
        if c["weight"]:
            kw["weight"] = torch.rand(shape[cdim], generator=g, dtype=torch.float64) + 0.1
        kinds["prob"] += c["prob"]
        kinds["weight"] += c["weight"]
        kinds["smoothing"] += c["smoothing"] > 0
        kinds["ignored"] += (not c["prob"]) and bool((target == c["ignore"]).any())
        kinds["uneven"] += shape[cdim] % world != 0
        kinds["empty_rank"] += shape[cdim] < world or -(-shape[cdim] // world) * (world - 1) >= shape[cdim]
        kinds["mesh2d"] += c["mesh2d"]
        upstream = torch.randn(batch if c["reduction"] == "none" else [], generator=g, dtype=torch.float64)

        ref_x = x.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_x, target, **kw)
        (ref * upstream).sum().backward()

        dx = distribute_tensor(x, mesh, [Shard(cdim)], src_data_rank=None)
        if c["mesh2d"]:
            dx = distribute_tensor(x, mesh2d, [Replicate(), Shard(cdim)], src_data_rank=None)
            dx = dx.detach().requires_grad_(True)
            leaf = dx
        elif c["noncontig"] and len(shape) >= 2 and shape[cdim] % world == 0:
            # the same logits reached through a transposed view
            dx = distribute_tensor(x.transpose(0, cdim).contiguous(), mesh, [Shard(0)], src_data_rank=None)
            dx = dx.detach().requires_grad_(True)
            leaf = dx
            dx = dx.transpose(0, cdim)
        else:
            dx = dx.detach().requires_grad_(True)
            leaf = dx
        with loss_parallel():
            with CommDebugMode() as fwd:
                loss = F.cross_entropy(dx, target, **kw)
            with CommDebugMode() as bwd:
                (loss.to_local() * upstream).sum().backward()
        fwd_counts.add(tuple(sorted(fwd.get_comm_counts().items())))
        bwd_counts.add(tuple(sorted(bwd.get_comm_counts().items())))
        msg = f"case {seed}: {c}"
        torch.testing.assert_close(loss.full_tensor(), ref, rtol=1e-10, atol=1e-12, equal_nan=True,
                                   msg=lambda m, msg=msg: f"{msg}: {m}")
        got = leaf.grad.full_tensor()
        if leaf is not dx:
            got = got.transpose(0, cdim)
        torch.testing.assert_close(got, ref_x.grad, rtol=1e-10, atol=1e-12, equal_nan=True,
                                   msg=lambda m, msg=msg: f"{msg}: {m}")
    return {"fwd": sorted(fwd_counts), "bwd": sorted(bwd_counts), "kinds": kinds, "cases": n}


@pytest.mark.parametrize("world", [2, 4])
def test_cross_entropy_surface_matches_plain_torch(pool2: RankPool, pool4: RankPool, world: int) -> None:
    pool = pool2 if world == 2 else pool4
    results = pool.run(_run_cases, CASES, timeout=240)
    kinds = results[0]["kinds"]
    print(f"loss_parallel: {CASES} generated cases at world={world}, covering {kinds}")
    assert min(v for k, v in kinds.items() if world == 4 or k != "mesh2d") > 0
    for res in results:
        assert res["fwd"] == [(("all_reduce", 2),)]  # row max; stacked row sums
        assert res["bwd"] == [()]  # the softmax gradient is folded into the loss backward


def _against_torch_counts(rank: int, world: int) -> list[dict[str, Any]]:
    """The same calls through torch.distributed.tensor's loss_parallel, counted by torch."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as t_distribute
    from torch.distributed.tensor import init_device_mesh as t_init_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TCommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel as t_loss_parallel

    from hp_dtensor import CommDebugMode, Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    out = []
    tmesh, mesh = t_init_mesh("cpu", (world,)), init_device_mesh("cpu", (world,))
    for shape, kw in [((6, 16), {}), ((2, 16, 3), {"reduction": "sum"}), ((6, 16), {"weight": torch.rand(16) + 0.1})]:
        torch.manual_seed(0)
        x = torch.randn(*shape, dtype=torch.float64)
        target = torch.randint(0, 16, [shape[0], *shape[2:]])
        counts = {}
        for who, dist_fn, m, lp, mode in [("torch", t_distribute, tmesh, t_loss_parallel, TCommDebugMode),
                                          ("ours", distribute_tensor, mesh, loss_parallel, CommDebugMode)]:
            dx = dist_fn(x, m, [TShard(1) if who == "torch" else Shard(1)]).detach().requires_grad_(True)
            with lp():
                with mode() as f:
                    loss = F.cross_entropy(dx, target, **kw)
                with mode() as b:
                    loss.backward()
            counts[who] = (sum(f.get_comm_counts().values()), sum(b.get_comm_counts().values()))
        out.append(counts)
    return out


def test_collectives_no_more_than_torch_loss_parallel(pool2: RankPool) -> None:
    for res in pool2.run(_against_torch_counts):
        for counts in res:
            assert counts["ours"][0] <= counts["torch"][0] and counts["ours"][1] <= counts["torch"][1], counts
            assert counts["ours"] == (2, 0)


def _bad_calls(rank: int, world: int) -> list[str]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    logits = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)], src_data_rank=None)
    seq = distribute_tensor(torch.randn(2, 4, 8), mesh, [Shard(2)], src_data_rank=None)
    good = torch.tensor([1, 2, 3, 4])
    calls = [
        lambda: F.cross_entropy(logits, torch.tensor([1, 2, 8, 4])),
        lambda: F.cross_entropy(logits, torch.tensor([1, -5, 3, 4])),
        lambda: F.cross_entropy(logits, good, label_smoothing=1.5),
        lambda: F.cross_entropy(logits, good, reduction="avg"),
        lambda: F.cross_entropy(logits, good, weight=torch.ones(3)),
        lambda: F.cross_entropy(logits, torch.tensor([1, 2, 3])),
        lambda: F.cross_entropy(distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)]), good),
        lambda: F.cross_entropy(seq, torch.zeros(2, 4, dtype=torch.long)),
    ]
    with loss_parallel():
        msgs = outcomes(calls)
    # the ranks are still in step: a collective after the errors completes
    torch.distributed.barrier()
    return msgs


def test_bad_arguments_raise_torchs_error_on_every_rank(pool2: RankPool) -> None:
    import torch
    import torch.nn.functional as F

    plain = torch.randn(4, 8)
    expected_torch = []
    for target, kw in [(torch.tensor([1, 2, 8, 4]), {}), (torch.tensor([1, -5, 3, 4]), {}),
                       (torch.tensor([1, 2, 3, 4]), {"label_smoothing": 1.5}),
                       (torch.tensor([1, 2, 3, 4]), {"reduction": "avg"}),
                       (torch.tensor([1, 2, 3, 4]), {"weight": torch.ones(3)}),
                       (torch.tensor([1, 2, 3]), {})]:
        with pytest.raises(Exception) as info:  # noqa: PT011
            F.cross_entropy(plain, target, **kw)
        expected_torch.append(f"{type(info.value).__name__}: {info.value}")
    results = pool2.run(_bad_calls)
    assert results[0] == results[1]
    msgs = results[0]
    assert msgs[:6] == expected_torch
    assert msgs[6].startswith("ValueError: loss_parallel") and "class dim" in msgs[6]
    assert msgs[7].startswith("ValueError: loss_parallel") and "flatten(0, -2)" in msgs[7]
