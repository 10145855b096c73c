# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,call-overload,union-attr"
"""loss_parallel on 2 MindSpore ranks, attacked as a careless user would, against torch's
``F.cross_entropy`` in float64 on one process:

- non-finite logits (-inf / +inf / NaN spans, often a whole vocab slice of one rank, rows ignored or
  not): the loss is finite exactly where torch's is, and equal to it;
- ``uint8`` targets with a vocab larger than 256 (a shifted ``uint8`` index must not wrap);
- empty batches: MindSpore's CPU ``sum`` of an empty tensor reads uninitialized memory and its
  ``any`` says True, so the loss must come out as torch's (0 for sum, NaN for mean) on every rank;
- misuse (bool / floating class-index targets, a weight Parameter, an exception inside nested
  contexts): the same exception on every rank, MindSpore's functions restored.

Seeded generated cases, counted in the output."""

from __future__ import annotations

import random

import numpy as np

from hp_dtensor.testing import RankPool, outcomes, rank_pool_fixture

pool = rank_pool_fixture(2, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
CASES = 24
TOL = {"rtol": 1.5e-4, "atol": 1e-4}


def _case(seed: int):
    """(logits float32, target int64, weight or None, smoothing, reduction)."""
    rng = random.Random(seed)
    rs = np.random.RandomState(seed)
    rows, classes = rng.randint(1, 6), 2 * rng.randint(1, 4)
    x = (rs.randn(rows, classes) * 3).astype(np.float32)
    target = rs.randint(0, classes, size=rows).astype(np.int64)
    for _ in range(rng.randint(1, 3)):
        row = rng.randrange(rows)
        lo = rng.randrange(classes)
        hi = rng.choice([lo + 1, classes // 2, classes]) if lo < classes // 2 else rng.choice([lo + 1, classes])
        x[row, lo:max(hi, lo + 1)] = rng.choice([-np.inf, -np.inf, np.inf, np.nan])
        if rng.random() < 0.5:
            target[row] = -100
    weight = (rs.rand(classes) + 0.1).astype(np.float32) if rng.random() < 0.4 else None
    return x, target, weight, rng.choice([0.0, 0.0, 0.2, 1.0]), rng.choice(["none", "sum", "mean"])


def _torch_loss(x, target, weight, smoothing, reduction):
    import torch
    import torch.nn.functional as F

    w = None if weight is None else torch.tensor(weight, dtype=torch.float64)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    t = torch.tensor(target).long()
    loss = F.cross_entropy(xt, t, weight=w, reduction=reduction, label_smoothing=smoothing)
    loss.sum().backward()
    # torch's log_softmax backward gives an ignored NaN / inf row NaN; the fused kernel never reads
    # an ignored row and gives it exactly 0 (by design)
    grad = xt.grad.masked_fill((t == -100).unsqueeze(1), 0.0)
    return loss.detach().numpy(), grad.numpy()


def _ms_losses(rank: int, world: int, calls):
    """Each call ``(logits, target, weight, smoothing, reduction)`` -> (loss, grad of this rank's
    slice, collective counts)."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor import CommDebugMode, DTensor, Shard, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for x, target, weight, smoothing, reduction in calls:
        w = None if weight is None else Tensor(weight)
        t = Tensor(target)

        def loss_fn(local, t=t, w=w, smoothing=smoothing, reduction=reduction):
            loss = ops.cross_entropy(DTensor.from_local(local, mesh, [Shard(1)]), t, w, -100, reduction, smoothing)
            return loss.to_local().sum(), loss.to_local()

        local = Tensor(np.ascontiguousarray(np.split(x, world, axis=1)[rank]))
        with loss_parallel(), CommDebugMode() as comm:
            (_, loss), grad = ms.value_and_grad(loss_fn, 0, has_aux=True)(local)
        out.append((loss.asnumpy(), grad.asnumpy(), comm.get_comm_counts()))
    return out


def test_nonfinite_logits_match_torch(pool: RankPool) -> None:
    cases = [_case(seed) for seed in range(CASES)]
    res = pool.run(_ms_losses, cases)
    finite = nonfinite = 0
    for seed, case in enumerate(cases):
        ref, ref_grad = _torch_loss(*case)
        finite += bool(np.isfinite(ref).all())
        nonfinite += not bool(np.isfinite(ref).all())
        for rank in range(2):
            loss, grad, counts = res[rank][seed]
            np.testing.assert_allclose(loss, ref, err_msg=f"case {seed} rank {rank}", equal_nan=True, **TOL)
            np.testing.assert_allclose(grad, np.split(ref_grad, 2, axis=1)[rank], equal_nan=True,
                                       err_msg=f"case {seed} rank {rank} grad", **TOL)
            assert counts == {"all_reduce": 2}, counts
    print(f"MindSpore loss_parallel non-finite logits: {CASES} generated cases x 2 ranks match torch "
          f"({finite} finite losses, {nonfinite} non-finite)")
    assert finite and nonfinite


def test_uint8_targets_and_empty_batches_match_torch(pool: RankPool) -> None:
    rs = np.random.RandomState(3)
    big = rs.randn(4, 600).astype(np.float32)
    empty = np.zeros((0, 8), np.float32)
    cases = [
        # 3 - 300 wraps to 215 in uint8: rank 1 (classes 300..599) would wrongly own it
        (big, np.array([3, 250, 255, 0], np.uint8), None, 0.0, "mean"),
        (big, np.array([3, 250, 255, 0], np.uint8), None, 0.1, "none"),
        *[(empty, np.zeros((0,), np.int64), None, s, r) for r in ("sum", "mean", "none") for s in (0.0, 0.1)],
    ]
    res = pool.run(_ms_losses, cases)
    for i, case in enumerate(cases):
        ref, _ = _torch_loss(*case)
        for rank in range(2):
            np.testing.assert_allclose(res[rank][i][0], ref, err_msg=f"case {i} rank {rank}", equal_nan=True, **TOL)
            assert res[rank][i][0].tobytes() == res[0][i][0].tobytes()  # the same bits on every rank
    print(f"MindSpore loss_parallel: {len(cases)} uint8 / empty-batch cases x 2 ranks match torch")


def _misuse(rank: int, world: int) -> list[str]:
    import mindspore as ms
    from mindspore import Tensor, mint, ops

    from hp_dtensor import DTensor, Shard, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = DTensor.from_local(Tensor(np.ones((4, 4), np.float32)), mesh, [Shard(1)])
    good = np.array([1, 2, 3, 4])
    calls = [
        lambda: ops.cross_entropy(x, Tensor(good > 2)),
        lambda: ops.cross_entropy(x, Tensor(good.astype(np.float32))),
        lambda: ops.cross_entropy(x, Tensor(good), ms.Parameter(Tensor(np.ones(8, np.float32)), name="w")),
    ]
    with loss_parallel():
        msgs = outcomes(calls)
    before = (ops.cross_entropy, mint.nn.functional.cross_entropy)
    try:
        with loss_parallel(), loss_parallel():
            raise KeyError("raised inside the context")
    except KeyError:
        pass
    msgs.append(f"restored: {(ops.cross_entropy, mint.nn.functional.cross_entropy) == before}")
    return msgs


def test_misuse_raises_the_same_error_on_every_rank(pool: RankPool) -> None:
    res = pool.run(_misuse)
    assert res[0] == res[1], res
    bool_t, float_t, weight_param, restored = res[0]
    assert bool_t.startswith("RuntimeError: loss_parallel") and "bool target" in bool_t
    assert float_t.startswith("RuntimeError: loss_parallel") and "target.long()" in float_t
    assert weight_param.startswith("NotImplementedError")
    assert restored == "restored: True"


def _one_rank_wrong(rank: int, world: int) -> list[str]:
    """A target wrong on one rank only (unseeded data): every rank raises, none waits forever."""
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Shard, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = DTensor.from_local(Tensor(np.ones((4, 4), np.float32)), mesh, [Shard(1)])
    good = np.array([1, 2, 3, 4])
    last = rank == world - 1
    calls = [
        lambda: ops.cross_entropy(x, Tensor(np.array([1, 2, 8, 4]) if last else good)),
        lambda: ops.cross_entropy(x, Tensor(good[:3] if last else good)),
    ]
    with loss_parallel():
        msgs = outcomes(calls)
        msgs.append(f"then: {float(ops.cross_entropy(x, Tensor(good)).to_local().asnumpy()):.6f}")
    return msgs


def test_arguments_wrong_on_one_rank_raise_everywhere(pool: RankPool) -> None:
    ok_rank, bad_rank = pool.run(_one_rank_wrong, timeout=60)
    assert ok_rank[-1] == bad_rank[-1]
    assert all(m.startswith("OtherRanksFailed: loss_parallel") for m in ok_rank[:-1]), ok_rank
    assert bad_rank[0] == "IndexError: Target 8 is out of bounds." and bad_rank[1].startswith("ValueError"), bad_rank
