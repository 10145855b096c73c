# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Random ops on DTensors against one process: after the same seed, a sharded result is the
matching slice of the single-process draw and a replicated one is that draw on every rank;
generator states stay in step; unseeded ranks are synchronised from the mesh's first rank."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4)

# Each op: (name, shape-preserving draw on a plain or DTensor ``x``).  The same lambda runs on the
# global plain tensor (reference) and on the DTensor.
_OPS = [
    "rand_like", "randn_like", "randint_like", "normal_", "uniform_", "bernoulli_p", "exponential_",
    "random_", "dropout", "trunc_normal_", "kaiming_uniform_", "xavier_normal_", "bernoulli_probs",
    "empty_like_uniform_",
]


def _apply(op: str, x: Any) -> Any:
    import torch
    import torch.nn.functional as F

    if op == "rand_like":
        return torch.rand_like(x)
    if op == "randn_like":
        return torch.randn_like(x)
    if op == "randint_like":
        return torch.randint_like(x, 3, 17)
    if op == "normal_":
        return x.normal_(0.5, 2.0)
    if op == "uniform_":
        return x.uniform_(-1.0, 3.0)
    if op == "bernoulli_p":
        return torch.bernoulli(x, 0.3)
    if op == "exponential_":
        return x.exponential_(2.0)
    if op == "random_":
        return x.random_(0, 1000)
    if op == "dropout":
        return F.dropout(x, p=0.4, training=True)
    if op == "trunc_normal_":
        return torch.nn.init.trunc_normal_(x, std=0.5, a=-1.0, b=1.0)
    if op == "kaiming_uniform_":
        return torch.nn.init.kaiming_uniform_(x, a=5**0.5)
    if op == "xavier_normal_":
        return torch.nn.init.xavier_normal_(x)
    if op == "bernoulli_probs":
        return torch.bernoulli(x.abs().clamp(max=1.0))
    if op == "empty_like_uniform_":
        return torch.empty_like(x).uniform_(0.01, 16).log()
    raise AssertionError(op)


_MESHES: dict[tuple[int, ...], list[tuple[str, ...]]] = {
    (4,): [("R",), ("S0",), ("S1",)],
    (2, 2): [("R", "R"), ("S0", "R"), ("R", "S1"), ("S0", "S1"), ("S1", "S0"), ("S0", "S0")],
}


def _placements(codes: tuple[str, ...]) -> list[Any]:
    from hp_dtensor import Partial, Replicate, Shard

    table = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial("sum"), "Pavg": Partial("avg")}
    return [table[c] for c in codes]


def _draws_match_one_process(rank: int, world: int, seed: int) -> dict[str, Any]:
    """Every op x placement: the DTensor draw equals the one-process draw bit for bit, and the
    generator state afterwards equals the one-process state (later draws stay in step)."""
    import torch

    from hp_dtensor import CommDebugMode, distribute_tensor, init_device_mesh, manual_seed

    checked = 0
    mismatches: list[str] = []
    comm_ops: list[str] = []
    for mesh_shape, layouts in _MESHES.items():
        mesh = init_device_mesh("cpu", mesh_shape)
        manual_seed(seed, mesh)
        for codes, op in itertools.product(layouts, _OPS):
            base = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed + 1))
            x = distribute_tensor(base.clone(), mesh, _placements(codes), src_data_rank=None)
            torch.manual_seed(seed)
            with CommDebugMode() as comm:
                got = _apply(op, x)
            # Draws are local; only value-dependent steps talk: bernoulli gathers its probabilities,
            # trunc_normal_ asks (any(), item()) whether a draw fell out of range.
            if comm.get_total_counts() and op not in ("bernoulli_probs", "trunc_normal_"):
                comm_ops.append(f"{op} {codes} {dict(comm.get_comm_counts())}")
            got_full = got.full_tensor()
            state_after = torch.get_rng_state()
            torch.manual_seed(seed)
            want = _apply(op, base.clone())
            checked += 1
            if not torch.equal(got_full, want) or not torch.equal(state_after, torch.get_rng_state()):
                mismatches.append(f"{mesh_shape} {codes} {op}")
    return {"checked": checked, "mismatches": mismatches, "comm": comm_ops}


def test_random_ops_match_one_process(pool4: RankPool) -> None:
    results = pool4.run(_draws_match_one_process, 1234, timeout=180)
    for r in results:
        assert r["mismatches"] == []
        assert r["comm"] == []
    n = results[0]["checked"]
    assert n == len(_OPS) * sum(len(v) for v in _MESHES.values())
    print(f"random ops vs one process: {n} cases (ops={len(_OPS)}), 0 mismatches")


def _replicated_identical(rank: int, world: int) -> list[Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Replicate, distribute_tensor, init_device_mesh, manual_seed

    mesh = init_device_mesh("cpu", (4,))
    manual_seed(7, mesh)
    x = distribute_tensor(torch.ones(16, 16), mesh, [Replicate()], src_data_rank=None)
    return [
        F.dropout(x, 0.5, True).to_local(),
        torch.randn_like(x).to_local(),
        x.clone().normal_().to_local(),
    ]


def test_replicated_draws_identical_on_every_rank(pool4: RankPool) -> None:
    import torch

    results = pool4.run(_replicated_identical)
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert torch.equal(a, b)
    # Not the trivial draw: dropout dropped something and kept something.
    drop = results[0][0]
    assert 0 < int((drop == 0).sum()) < drop.numel()


def _unseeded_ranks_are_synchronised(rank: int, world: int) -> dict[str, Any]:
    import warnings

    import torch

    from hp_dtensor import CommDebugMode, Replicate, Shard, distribute_tensor, init_device_mesh
    from hp_dtensor.api.rng_tracker import forget_synced

    forget_synced()
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(100 + rank)  # a careless user: every rank seeded differently
    x = distribute_tensor(torch.zeros(6, 4), mesh, [Replicate(), Shard(0)], src_data_rank=None)
    with warnings.catch_warnings(record=True) as caught, CommDebugMode() as comm:
        warnings.simplefilter("always")
        y = torch.rand_like(x)
        z = torch.rand_like(x)
    # Reference: rank 0's seed on one process.
    torch.manual_seed(100)
    want_y = torch.rand(6, 4)
    want_z = torch.rand(6, 4)
    return {
        "warned": any("generator state differed" in str(w.message) for w in caught),
        "counts": dict(comm.get_comm_counts()),
        "y": torch.equal(y.full_tensor(), want_y),
        "z": torch.equal(z.full_tensor(), want_z),
    }


def test_unseeded_ranks_take_the_first_ranks_state(pool4: RankPool) -> None:
    results = pool4.run(_unseeded_ranks_are_synchronised)
    assert [r["warned"] for r in results] == [False, True, True, True]
    for r in results:
        assert r["y"] and r["z"]
        # One broadcast per mesh dim, once; the second draw issues none.
        assert r["counts"] == {"broadcast": 2}


def _dropout_grad(rank: int, world: int) -> list[bool]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh, manual_seed

    mesh = init_device_mesh("cpu", (4,))
    manual_seed(3, mesh)
    base = torch.randn(8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    x = distribute_tensor(base.clone(), mesh, [Shard(1)], src_data_rank=None).requires_grad_()
    wd = distribute_tensor(w, mesh, [Shard(1)], src_data_rank=None)
    torch.manual_seed(11)
    (F.dropout(x, 0.3, True) * wd).sum().backward()
    ref = base.clone().requires_grad_()
    torch.manual_seed(11)
    out_ref = F.dropout(ref, 0.3, True)
    (out_ref * w).sum().backward()
    torch.manual_seed(11)
    fwd = F.dropout(distribute_tensor(base.clone(), mesh, [Shard(1)], src_data_rank=None), 0.3, True)
    return [torch.equal(x.grad.full_tensor(), ref.grad), torch.equal(fwd.full_tensor(), out_ref.detach())]


def test_dropout_forward_and_gradient_match_one_process(pool4: RankPool) -> None:
    for r in pool4.run(_dropout_grad):
        assert r == [True, True]


def _partial_inputs(rank: int, world: int) -> dict[str, Any]:
    import torch

    from hp_dtensor import DTensor, Partial, Replicate, init_device_mesh, manual_seed

    mesh = init_device_mesh("cpu", (2, 2))
    manual_seed(21, mesh)
    out: dict[str, Any] = {}
    for reduce_op in ("sum", "avg", "max"):
        p = DTensor.from_local(torch.full((4, 4), float(rank)), mesh, [Partial(reduce_op), Replicate()])
        torch.manual_seed(21)
        p.normal_()
        like = torch.randn_like(p)
        torch.manual_seed(21)
        want_fill = torch.randn(4, 4)
        want_like = torch.randn(4, 4)
        out[reduce_op] = (
            torch.equal(p.full_tensor(), want_fill),
            p.placements[0] == Partial(reduce_op),
            torch.equal(like.full_tensor(), want_like),
            like.placements[0] == Replicate(),
        )
    return out


def test_random_ops_on_partial_inputs(pool4: RankPool) -> None:
    for r in pool4.run(_partial_inputs):
        for reduce_op, checks in r.items():
            assert checks == (True, True, True, True), reduce_op


def _manual_seed_errors(rank: int, world: int, case: str) -> None:
    from hp_dtensor import init_device_mesh, manual_seed

    mesh = init_device_mesh("cpu", (4,))
    if case == "different":
        manual_seed(10 + (rank == 2), mesh)
    elif case == "float":
        manual_seed(1.5, mesh)
    elif case == "range":
        manual_seed(2**64, mesh)
    elif case == "big":
        manual_seed(2**64 - 1 if rank else 2**63, mesh)


@pytest.mark.parametrize(
    ("case", "exc", "text"),
    [
        ("different", ValueError, "rank 2: 11"),
        ("float", TypeError, "seed must be an int"),
        ("range", ValueError, "out of range"),
        ("big", ValueError, "rank 0: 9223372036854775808"),
    ],
)
def test_manual_seed_fails_on_every_rank(pool4: RankPool, case: str, exc: type, text: str) -> None:
    from hp_dtensor.testing import RankError

    with pytest.raises(RankError) as info:
        pool4.run(_manual_seed_errors, case, timeout=30)
    msg = str(info.value)
    # Every rank raised, each with the same message.
    assert "raised on ranks [0, 1, 2, 3]" in msg
    assert msg.count(f"{exc.__name__}: ") == 4 and msg.count(text) >= 4
