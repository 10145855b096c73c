# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""``loss_parallel`` attacked as a careless user would, against plain ``F.cross_entropy`` on one
process (float64 unless the case is about a low-precision dtype):

- non-finite logits: ``-inf`` / ``+inf`` / NaN anywhere, a vocab slice that is all ``-inf`` on one
  rank while the target lives on another, NaN or ``-inf`` padding rows that are ignored: the loss
  is finite exactly where torch's is, NaN/inf where torch's is (no ``0 * inf`` leaking in);
- ``uint8`` targets with a vocab larger than 256 (a shifted ``uint8`` index must not wrap);
- bf16/fp16 logits against torch in the same dtype, 1e4-sized logits, empty batches,
  label_smoothing 1.0, all-zero class weights, every target ignored;
- the separate ``log_softmax`` + ``nll_loss`` route with an uneven vocab and ranks holding no class;
- ``torch.autocast``: the loss is computed in float32, as torch does;
- misuse (bool / floating class-index targets, a weight or target that requires grad, (B, S, V)
  logits sharded on the last dim, Shard on both mesh dims): the same exception on every rank, and
  the ranks still in step afterwards.

Seeded generated cases, counted in the output."""

from __future__ import annotations

import random
from typing import Any

from hp_dtensor.testing import RankPool, outcomes, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=240)
pool4 = rank_pool_fixture(4, timeout=240)

NONFINITE_CASES = 48


def _nonfinite_case(seed: int, world: int) -> dict[str, Any]:
    rng = random.Random(seed)
    classes = rng.choice([world * rng.randint(1, 4), rng.randint(1, 3 * world)])
    return {
        "rows": rng.randint(1, 6),
        "classes": classes,
        # (row, first class, last class + 1, value): a span of one value, often a whole vocab slice
        "spans": [(rng.random(), rng.random(), rng.random(), rng.choice([float("-inf"), float("-inf"),
                   float("inf"), float("nan")])) for _ in range(rng.randint(1, 3))],
        "ignore_span_rows": rng.random() < 0.5,
        "weight": rng.random() < 0.4,
        "smoothing": rng.choice([0.0, 0.0, 0.2, 1.0]),
        "reduction": rng.choice(["none", "sum", "mean"]),
    }


def _nonfinite(rank: int, world: int, n: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    seen = {"finite_loss_with_nonfinite_logits": 0, "nonfinite_loss": 0, "ignored_nonfinite_rows": 0}
    counts = set()
    for seed in range(n):
        c = _nonfinite_case(seed, world)
        g = torch.Generator().manual_seed(seed)
        rows, classes = c["rows"], c["classes"]
        x = torch.randn(rows, classes, generator=g, dtype=torch.float64) * 3
        target = torch.randint(0, classes, (rows,), generator=g)
        span_rows = set()
        for r, a, b, v in c["spans"]:
            row = int(r * rows)
            lo = int(a * classes)
            hi = max(lo + 1, int(b * classes) + 1)
            x[row, lo:hi] = v
            span_rows.add(row)
        if c["ignore_span_rows"]:
            for row in span_rows:
                target[row] = -100
        kw: dict[str, Any] = {"reduction": c["reduction"], "label_smoothing": c["smoothing"]}
        if c["weight"]:
            kw["weight"] = torch.rand(classes, generator=g, dtype=torch.float64) + 0.1
        ref_x = x.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_x, target, **kw)
        ref.sum().backward()
        dx = distribute_tensor(x, mesh, [Shard(1)], src_data_rank=None).detach().requires_grad_(True)
        with loss_parallel(), CommDebugMode() as comm:
            loss = F.cross_entropy(dx, target, **kw)
            loss.to_local().sum().backward()
        counts.add(tuple(sorted(comm.get_comm_counts().items())))
        msg = f"case {seed}: {c}"
        torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=1e-10, atol=1e-12, equal_nan=True,
                                   msg=lambda m, msg=msg: f"{msg}: loss {m}")
        got = dx.grad.full_tensor()
        # Ignored rows: torch's log_softmax backward reads the row and gives NaN for a NaN / inf row;
        # the fused kernel never reads an ignored row and gives exactly 0 (by design).
        ignored = target == -100
        want = ref_x.grad.clone()
        want[ignored] = 0.0
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, equal_nan=True,
                                   msg=lambda m, msg=msg: f"{msg}: grad {m}")
        nonfinite_ignored = bool((ignored & ~x.isfinite().all(1)).any())
        seen["ignored_nonfinite_rows"] += nonfinite_ignored
        seen["finite_loss_with_nonfinite_logits"] += bool(ref.isfinite().all())
        seen["nonfinite_loss"] += not bool(ref.isfinite().all())
    return {"seen": seen, "counts": sorted(counts)}


def test_nonfinite_logits_match_torch(pool2: RankPool) -> None:
    res = pool2.run(_nonfinite, NONFINITE_CASES)
    seen = res[0]["seen"]
    print(f"loss_parallel non-finite logits: {NONFINITE_CASES} generated cases on 2 ranks, {seen}")
    assert min(seen.values()) > 0
    assert all(r["counts"] == [(("all_reduce", 2),)] for r in res)


def _edge_cases(rank: int, world: int) -> list[tuple[str, str]]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 10, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, 10, (6,), generator=g)
    big = torch.randn(4, 600, generator=g, dtype=torch.float64)
    cases: list[tuple[str, torch.Tensor, torch.Tensor, dict[str, Any], torch.dtype, dict[str, float]]] = [
        # 3 - 300 wraps to 215 in uint8: rank 1 (classes 300..599) would wrongly own it
        ("uint8 target, vocab 600", big, torch.tensor([3, 250, 255, 0], dtype=torch.uint8), {}, torch.float64, {}),
        ("int32 target", x, t.int(), {}, torch.float64, {}),
        ("logits 1e4", x * 1e4, t, {"label_smoothing": 0.1}, torch.float64, {}),
        ("logits -1e4 .. 1e4 float32", x * 1e4, t, {}, torch.float32, {"rtol": 1e-5, "atol": 1e-2}),
        ("every target ignored, mean", x, torch.full((6,), -100), {}, torch.float64, {}),
        ("every target ignored, smoothing", x, torch.full((6,), -100), {"label_smoothing": 0.3}, torch.float64, {}),
        ("label_smoothing 1.0", x, t, {"label_smoothing": 1.0}, torch.float64, {}),
        ("all-zero weight", x, t, {"weight": torch.zeros(10, dtype=torch.float64)}, torch.float64, {}),
        ("zero weight at targets", x, t, {"weight": torch.ones(10, dtype=torch.float64).index_fill(0, t, 0.0)},
         torch.float64, {}),
        ("empty batch, mean", x[:0], t[:0], {}, torch.float64, {}),
        ("empty batch, sum", x[:0], t[:0], {"reduction": "sum"}, torch.float64, {}),
        ("empty batch, none", x[:0], t[:0], {"reduction": "none"}, torch.float64, {}),
        # low precision: torch in the same dtype on one process is the reference
        ("bf16", x, t, {}, torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2}),
        ("bf16 smoothing + weight", x, t, {"label_smoothing": 0.1, "weight": torch.rand(10, generator=g) + 0.5},
         torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2}),
        ("fp16", x, t, {}, torch.float16, {"rtol": 2e-3, "atol": 2e-3}),
        ("bf16 logits 1e4", x * 1e4, t, {}, torch.bfloat16, {"rtol": 1e-2, "atol": 1e-2}),
    ]
    out = []
    for name, logits, target, kw, dtype, tol in cases:
        assert not logits.requires_grad
        kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        ref_x = logits.detach().to(dtype).clone().requires_grad_(True)
        ref = F.cross_entropy(ref_x, target.long(), **kw)
        ref.sum().backward()
        dx = distribute_tensor(logits.to(dtype), mesh, [Shard(1)], src_data_rank=None).detach().requires_grad_(True)
        with loss_parallel():
            loss = F.cross_entropy(dx, target, **kw)
            loss.to_local().sum().backward()
        args = {"rtol": 1e-10, "atol": 1e-12, **tol, "equal_nan": True}
        try:
            torch.testing.assert_close(loss.full_tensor(), ref.detach(), **args)
            torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad, **args)
            if dtype in (torch.bfloat16, torch.float16):  # and against float64, one dtype's rounding away
                ref64 = F.cross_entropy(logits, target.long(), **{k: (v.double() if isinstance(v, torch.Tensor)
                                                                    else v) for k, v in kw.items()})
                torch.testing.assert_close(loss.full_tensor().double(), ref64, rtol=3e-2, atol=3e-2)
            out.append((name, "ok"))
        except AssertionError as e:
            out.append((name, str(e)))
    return out


def test_edge_cases_match_torch(pool2: RankPool) -> None:
    res = pool2.run(_edge_cases)
    assert res[0] == res[1]
    bad = [r for r in res[0] if r[1] != "ok"]
    assert not bad, bad
    print(f"loss_parallel edge cases: {len(res[0])} on 2 ranks match torch")


def _separate_ops(rank: int, world: int) -> int:
    """``log_softmax`` then ``nll_loss`` (not the fused kernel) with uneven vocabs down to ranks
    holding no class, -inf logits on a rank that does not own the target, and uint8 targets."""
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    n = 0
    for seed, classes in enumerate([7, 1, world + 1, 3 * world, 300, 2 * world - 1]):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, classes, generator=g, dtype=torch.float64)
        target = torch.randint(0, classes, (5,), generator=g)
        target[1] = -100
        x[2, : classes // 2] = float("-inf")
        target[2] = classes - 1
        for tgt in ([target, target.to(torch.uint8)] if classes <= 256 else [target]):
            for reduction in ("mean", "sum", "none"):
                ref_x = x.clone().requires_grad_(True)
                ref = F.nll_loss(F.log_softmax(ref_x, 1), target, reduction=reduction)
                ref.sum().backward()
                dx = distribute_tensor(x, mesh, [Shard(1)], src_data_rank=None).detach().requires_grad_(True)
                with loss_parallel():
                    loss = F.nll_loss(F.log_softmax(dx, 1), tgt, reduction=reduction)
                    loss.to_local().sum().backward()
                msg = f"classes={classes} reduction={reduction} target dtype {tgt.dtype}"
                torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=1e-10, atol=1e-12,
                                           msg=lambda m, msg=msg: f"{msg}: loss {m}")
                torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad, rtol=1e-10, atol=1e-12,
                                           msg=lambda m, msg=msg: f"{msg}: grad {m}")
                n += 1
    return n


def test_log_softmax_then_nll_loss_uneven_vocab(pool2: RankPool) -> None:
    n = pool2.run(_separate_ops)
    print(f"loss_parallel log_softmax + nll_loss: {n[0]} cases on 2 ranks match torch")
    assert n[0] == n[1] > 0


def _misuse(rank: int, world: int) -> list[str]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    logits = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)], src_data_rank=None)
    seq = distribute_tensor(torch.randn(2, 3, 8), mesh, [Shard(-1)], src_data_rank=None)
    good = torch.tensor([1, 2, 3, 4])
    calls = [
        lambda: F.cross_entropy(logits, good > 2),
        lambda: F.cross_entropy(logits, good.float()),
        lambda: F.cross_entropy(logits, good, weight=torch.ones(8, requires_grad=True)),
        lambda: F.cross_entropy(logits, torch.rand(4, 8, requires_grad=True)),
        lambda: F.cross_entropy(seq, torch.zeros(2, 3, dtype=torch.long)),
        lambda: F.cross_entropy(distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]), good),
        # log_softmax + nll_loss: a target no rank owns must not silently add 0
        lambda: F.nll_loss(F.log_softmax(logits, 1), torch.tensor([1, 2, 8, 4])),
        lambda: F.nll_loss(F.log_softmax(logits, 1), torch.tensor([1, -5, 3, 4]), reduction="sum"),
    ]
    if world == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        both = distribute_tensor(torch.randn(4, 8), mesh2d, [Shard(1), Shard(1)], src_data_rank=None)
        batch_and_vocab = distribute_tensor(torch.randn(4, 8), mesh2d, [Shard(0), Shard(1)], src_data_rank=None)
        calls = [lambda: F.cross_entropy(both, good), lambda: F.cross_entropy(batch_and_vocab, good)]
    with loss_parallel():
        msgs = outcomes(calls)
    torch.distributed.barrier()  # the ranks are still in step
    return msgs


def test_misuse_raises_the_same_error_on_every_rank(pool2: RankPool, pool4: RankPool) -> None:
    res = pool2.run(_misuse)
    assert res[0] == res[1]
    bool_t, float_t, weight_grad, target_grad, seq, replicated, nll_high, nll_negative = res[0]
    assert nll_high == "IndexError: Target 8 is out of bounds."
    assert nll_negative == "IndexError: Target -5 is out of bounds."
    assert bool_t.startswith("RuntimeError: loss_parallel") and "bool target" in bool_t
    assert float_t.startswith("RuntimeError: loss_parallel") and "target.long()" in float_t
    assert weight_grad.startswith("NotImplementedError") and target_grad == weight_grad
    assert seq.startswith("ValueError: loss_parallel") and "flatten(0, -2)" in seq
    assert replicated.startswith("ValueError: loss_parallel")
    res4 = pool4.run(_misuse)
    assert all(r == res4[0] for r in res4)
    assert all(m.startswith("ValueError: loss_parallel: cross_entropy needs logits sharded on the class dim")
               for m in res4[0]), res4[0]
    print(f"loss_parallel misuse: {len(res[0])} bad calls on 2 ranks, {len(res4[0])} on a 2x2 mesh, "
          f"same error on every rank")


def _autocast(rank: int, world: int) -> list[tuple[str, float, str, float, float]]:
    """bf16 / fp16 logits under ``torch.autocast``, ours against torch.distributed.tensor's own
    ``loss_parallel`` (autocast runs cross_entropy in float32)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as t_distribute
    from torch.distributed.tensor import init_device_mesh as t_init_mesh
    from torch.distributed.tensor.parallel import loss_parallel as t_loss_parallel

    from hp_dtensor import CommDebugMode, Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh, tmesh = init_device_mesh("cpu", (world,)), t_init_mesh("cpu", (world,))
    out = []
    for seed, dtype in enumerate([torch.bfloat16, torch.float16, torch.bfloat16]):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(6, 64, generator=g) * 4).to(dtype)
        t = torch.randint(0, 64, (6,), generator=g)
        kw: dict[str, Any] = {"reduction": "sum"} if seed else {}  # what torch's loss_parallel supports here
        d = distribute_tensor(x, mesh, [Shard(1)], src_data_rank=None).requires_grad_(True)
        td = t_distribute(x, tmesh, [TShard(1)], src_data_rank=None).requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype):
            with loss_parallel(), CommDebugMode() as comm:
                ours = F.cross_entropy(d, t, **kw)
            with t_loss_parallel():
                theirs = F.cross_entropy(td, t, **kw)
        with loss_parallel():
            ours.backward()
        with t_loss_parallel():
            theirs.backward()
        assert comm.get_comm_counts() == {"all_reduce": 2}
        assert d.grad.dtype == dtype
        out.append((str(ours.dtype), ours.full_tensor().item(), str(theirs.dtype), theirs.full_tensor().item(),
                    (d.grad.full_tensor().float() - td.grad.full_tensor().float()).abs().max().item()))
    return out


def test_autocast_computes_in_float32_like_torch(pool2: RankPool) -> None:
    for ours_dtype, ours, theirs_dtype, theirs, grad_diff in pool2.run(_autocast)[0]:
        assert ours_dtype == theirs_dtype == "torch.float32"
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
        assert grad_diff <= 1e-3, grad_diff
    print("loss_parallel under autocast: 3 bf16/fp16 cases equal torch's loss_parallel in float32")


def _one_rank_wrong(rank: int, world: int) -> list[str]:
    """Per-rank plain arguments that are wrong on one rank only (an unseeded target, a weight built
    from local data): every rank raises, none is left waiting in the all_reduce."""
    import torch
    import torch.nn.functional as F

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    logits = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)], src_data_rank=None)
    good = torch.tensor([1, 2, 3, 4])
    last = rank == world - 1
    calls = [
        lambda: F.cross_entropy(logits, torch.tensor([1, 2, 8, 4]) if last else good),
        lambda: F.cross_entropy(logits, good[:3] if last else good),
        lambda: F.cross_entropy(logits, good, weight=torch.ones(7 if last else 8)),
        lambda: F.cross_entropy(logits, good, reduction="avg" if last else "mean"),
        lambda: F.cross_entropy(logits, good > 2 if last else good),
        lambda: F.cross_entropy(logits, good, weight=torch.ones(8, requires_grad=last)),
    ]
    with loss_parallel():
        msgs = outcomes(calls)
        loss = F.cross_entropy(logits, good)  # the ranks are still in step: a good call works
    msgs.append(f"then: {loss.full_tensor().item():.6f}")
    return msgs


def test_arguments_wrong_on_one_rank_raise_everywhere(pool2: RankPool) -> None:
    res = pool2.run(_one_rank_wrong, timeout=60)
    ok_rank, bad_rank = res
    assert ok_rank[-1] == bad_rank[-1] and ok_rank[-1].startswith("then: ")
    for ok, bad in zip(ok_rank[:-1], bad_rank[:-1]):
        assert ok.startswith("OtherRanksFailed: loss_parallel") and "same target" in ok, ok
        assert bad != "no error" and not bad.startswith("OtherRanksFailed"), bad
    print(f"loss_parallel: {len(ok_rank) - 1} calls wrong on one rank only raise on both ranks")
