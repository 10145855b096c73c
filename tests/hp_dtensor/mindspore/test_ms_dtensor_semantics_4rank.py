# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,func-returns-value,union-attr,var-annotated,assignment"
"""MindSpore DTensor on 4 mccl ranks against one-process MindSpore (and numpy), for the classes of
silent wrong answers found by trying it as a user would:

* every dtype moves bit for bit through distribute_tensor, redistribute and Partial reductions,
  on the world group (1-D mesh) and on subgroups (2x2 mesh);
* a number or scalar tensor combined with a Partial DTensor is applied once, not once per rank;
  casts to integers reduce first; in-place scalar updates of a Partial refuse;
* the dispatch cache tells ``sum((0, 1))`` from ``sum(0, True)``;
* mixed Partial reduce ops are rejected (as torch rejects them), except sum with avg, which
  commute and give torch's numbers (as torch accepts them);
* Python values (item, float, int, bool, numel, size, nbytes, tolist, len) are global and equal on
  every rank;
* ops.stack / ops.addn dispatch, and a plain tensor on the left of an operator gets the library's
  mixing error;
* from_local(run_check=True) compares a fixed-size record (no hang, no poisoned communicator);
* the gradient of a Partial("avg") source is torch's (G, not G/n);
* random ops on replicated DTensors give the same values on every rank.

The four ranks and MindSpore's scheduler start once for the module."""

from __future__ import annotations

import numpy as np
import pytest
from ms_gradient_cases import slice_of

from hp_dtensor.testing import rank_pool_fixture
from hp_dtensor.testing.mixed_partial_cases import check_mixed_partials, mixed_partial_case

pool = rank_pool_fixture(4, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})

DTYPES = ("float32", "float16", "float64", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool_")


# ---------------------------------------------------------------- dtypes
def _global_array(name, seed):
    """A (4, 8) array of dtype ``name`` (bfloat16 as float32 values it represents exactly), with
    the values a lossy path would break: signed zeros, NaN, infinities, subnormals, float64 digits
    float32 lacks, int64 beyond 2**53, the ends of each integer range."""
    rs = np.random.RandomState(seed)
    if name == "bool_":
        return rs.rand(4, 8) > 0.5
    if name in ("float32", "float16", "float64", "bfloat16"):
        np_dt = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": np.float32}[name]
        a = rs.randn(4, 8).astype(np_dt)
        if name == "float64":
            a = a + 1e-12 * rs.randn(4, 8)
        finfo = np.finfo(np_dt)
        a.flat[:6] = [-0.0, np.nan, np.inf, -np.inf, finfo.tiny / 4, -finfo.tiny / 8]
        if name == "bfloat16":  # keep only the top 16 bits: values bfloat16 holds exactly
            a = (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        return a
    info = np.iinfo(getattr(np, name))
    a = rs.randint(info.min, info.max, size=(4, 8), dtype=getattr(np, name))
    a.flat[:2] = [info.min, info.max]
    if name == "int64":
        a.flat[2] = 2**53 + 1
    return a


def _tensor(a, name):
    import mindspore as ms
    from mindspore import Tensor

    t = Tensor(a)
    return t.astype(ms.bfloat16) if name == "bfloat16" else t


def _bits(t, name):
    """The tensor's values as raw bytes (bfloat16 widened to float32 exactly first)."""
    import mindspore as ms

    a = t.astype(ms.float32).asnumpy() if name == "bfloat16" else t.asnumpy()
    return str(t.dtype), np.ascontiguousarray(a).tobytes()


def _dtype_cases(rank, world, mesh_shape):
    """distribute_tensor from rank 0 (others pass zeros), redistribute between shard/replicate
    layouts, Partial sum/max/min reductions: every result's bytes against numpy's."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    layouts = ([(Shard(0),), (Shard(1),), (Replicate(),)] if len(mesh_shape) == 1
               else [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()), (Replicate(), Replicate())])
    failures, checked = [], 0

    def expect(got, want_np, name, what):
        nonlocal checked
        checked += 1
        want = _tensor(want_np, name)
        if _bits(got, name) != _bits(want, name):
            failures.append(f"{name} {what}: got {got.dtype} {got.asnumpy() if name != 'bfloat16' else ''}")

    for name in DTYPES:
        A = _global_array(name, 0)
        mine = A if rank == 0 else np.zeros_like(A)
        for src in layouts:
            try:
                dt = distribute_tensor(_tensor(mine, name), mesh, src)
                expect(dt.to_local(), slice_of(A, src, mesh_shape, coord), name, f"distribute {src}")
                expect(dt.full_tensor(), A, name, f"full_tensor from {src}")
                for dst in layouts:
                    if dst != src:
                        expect(dt.redistribute(mesh, dst).to_local(), slice_of(A, dst, mesh_shape, coord), name,
                               f"{src}->{dst}")
            except Exception as e:  # noqa: BLE001 -- a raise is one more wrong answer to report
                failures.append(f"{name} {src}: raised {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        # Partial reductions over the whole mesh: each rank holds its own term.
        for op in ("max", "min", "sum"):
            if name == "bool_" and op == "sum":
                continue
            terms = [_global_array(name, 10 + r) for r in range(world)]
            if op == "sum" and name == "float64":  # exact in float64, not in float32
                terms = [np.full((4, 8), 2.0**30 + r * 2.0**-20) for r in range(world)]
            elif op == "sum" and name in ("float32", "float16", "bfloat16"):
                # values whose sums every float type holds exactly, so any summation order agrees
                terms = [(np.clip(np.round(np.random.RandomState(20 + r).randn(4, 8) * 2), -8, 8) / 2)
                         .astype(np.float16 if name == "float16" else np.float32) for r in range(world)]
            pl = tuple(Partial(op) for _ in mesh_shape)
            stacked = np.stack(terms)
            want = {"sum": lambda s: s.sum(axis=0, dtype=s.dtype), "max": lambda s: s.max(axis=0),
                    "min": lambda s: s.min(axis=0)}[op](stacked)
            try:
                got = DTensor.from_local(_tensor(terms[rank], name), mesh, pl).full_tensor()
                expect(got, want, name, f"Partial({op}) reduce")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name} Partial({op}): raised {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    # bits of float32 through a subgroup: the -0.0 padding keeps signed zeros and NaN payloads
    bits = np.array([0x80000000, 0x7FC01234, 0x00000001, 0x80000001], np.uint32).view(np.float32)
    dt = DTensor.from_local(Tensor(bits.reshape(1, 4)), mesh, [Shard(0)] * len(mesh_shape))
    expect(dt.full_tensor(), np.tile(bits.reshape(1, 4), (world, 1)), "float32", "payload bits")
    del ms
    return checked, failures


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_every_dtype_moves_bit_for_bit(pool, mesh_shape):
    results = pool.run(_dtype_cases, mesh_shape)
    checked = results[0][0]
    print(f"dtype cases on mesh {mesh_shape}: {checked} results per rank, {len(DTYPES)} dtypes")
    for rank, (_, failures) in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures)
    assert checked >= 140


# ---------------------------------------------------------------- numbers next to a Partial
def _partial_terms(A, rank, world):
    """Rank ``rank``'s term of A as a Partial sum (the terms are not integers)."""
    spread = np.random.RandomState(5).randn(*A.shape).astype(np.float32)
    return (A / world + (rank - (world - 1) / 2.0) * spread).astype(np.float32)


def _scalar_op_cases(rank, world, mesh_shape):
    import mindspore as ms
    from mindspore import Tensor, mint, ops

    from hp_dtensor import DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    A = (np.random.RandomState(3).rand(4, 6).astype(np.float32) * 4 + 1.3).astype(np.float32)
    G = np.random.RandomState(4).randn(4, 6).astype(np.float32)
    pl = [Partial("sum")] * len(mesh_shape)
    local = Tensor(_partial_terms(A, rank, world))
    cases = {
        "ops.add(x, 1)": lambda x: ops.add(x, 1),
        "ops.add(x, 2.5)": lambda x: ops.add(x, 2.5),
        "ops.sub(x, 1)": lambda x: ops.sub(x, 1),
        "1 - x": lambda x: 1 - x,
        "x + Tensor(c)": lambda x: x + Tensor(2.0),
        "x - Tensor(c)": lambda x: x - Tensor(2.0),
        "Tensor(c) + x": lambda x: Tensor(2.0) + x,
        "Tensor(c) - x": lambda x: Tensor(2.0) - x,
        "ops.div(1, x)": lambda x: ops.div(1, x),
        "x + 1": lambda x: x + 1,
        "mint.add(x, 1)": lambda x: mint.add(x, 1),
        "x * 2": lambda x: x * 2,
        "x / 2": lambda x: x / 2,
        "ops.mul(x, Tensor(c))": lambda x: ops.mul(x, Tensor(3.0)),
        "x.astype(int32)": lambda x: x.astype(ms.int32),
        "x.to(int32)": lambda x: x.to(ms.int32),
    }
    out = {}
    for name, f in cases.items():
        got = f(DTensor.from_local(local, mesh, pl)).full_tensor().asnumpy()
        want = f(Tensor(A)).asnumpy()
        err = float(np.max(np.abs(got.astype(np.float64) - want)))
        grad_err = None
        if not name.startswith("x.a") and not name.startswith("x.to"):
            def loss(xl, f=f):
                return (f(DTensor.from_local(xl, mesh, pl)).full_tensor() * Tensor(G)).sum()

            def ref(X, f=f):
                return (f(X) * Tensor(G)).sum()

            # torch's convention: a Partial term's gradient is the global one
            grad_err = float(np.max(np.abs(ms.grad(loss)(local).asnumpy() - ms.grad(ref)(Tensor(A)).asnumpy())))
        out[name] = (err, grad_err)
    try:
        DTensor.from_local(ops.deepcopy(local), mesh, pl).add_(1)
        out["x.add_(1)"] = "no error"
    except ValueError as e:
        out["x.add_(1)"] = str(e)
    return out


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_numbers_next_to_a_partial_are_applied_once(pool, mesh_shape):
    results = pool.run(_scalar_op_cases, mesh_shape)
    n_ops = 0
    for out in results:
        inplace = out.pop("x.add_(1)")
        assert "partial term" in inplace and "redistribute" in inplace, inplace
        for name, (err, grad_err) in out.items():
            assert err <= 1e-5 * 8, (name, err)
            assert grad_err is None or grad_err <= 1e-5 * 8, (name, grad_err)
        n_ops = len(out)
    print(f"scalar-next-to-Partial ops on mesh {mesh_shape}: {n_ops} ops, values and gradients")


# ---------------------------------------------------------------- the dispatch cache
def _cache_cases(rank, world):
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Partial, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    A = np.random.RandomState(6).randn(4, 8, 3).astype(np.float32)
    X = Tensor(A)
    out = []
    for pl in ([Shard(0)], [Shard(1)], [Partial("sum")]):
        local = Tensor(_partial_terms(A, rank, world)) if pl[0].is_partial() else Tensor(slice_of(A, pl, (world,), (rank,)))
        calls = [
            ("sum((0, 1))", lambda x: x.sum((0, 1))),
            ("sum(0, True)", lambda x: x.sum(0, True)),
            ("sum(1, True)", lambda x: x.sum(1, True)),
            ("sum((0,), True)", lambda x: x.sum((0,), True)),
            ("sum([0, 1])", lambda x: x.sum([0, 1])),
            ("mean((0, 1))", lambda x: x.mean((0, 1))),
            ("mean(0, True)", lambda x: x.mean(0, True)),
            ("mean(0)", lambda x: x.mean(0)),
            ("mean(-1, keep_dims=True)", lambda x: x.mean(-1, keep_dims=True)),
            ("mean(axis=(0, 2))", lambda x: x.mean(axis=(0, 2))),
            ("ops.add(x, 1)", lambda x: ops.add(x, 1)),
            ("ops.add(x, True)", lambda x: ops.add(x, True)),
            ("ops.add(x, 1.0)", lambda x: ops.add(x, 1.0)),
        ]
        for name, f in calls:
            got = f(DTensor.from_local(local, mesh, pl)).full_tensor()
            want = f(X)
            ok = tuple(got.shape) == tuple(want.shape) and np.allclose(got.asnumpy(), want.asnumpy(), atol=1e-5)
            out.append((str(pl), name, ok, tuple(got.shape), tuple(want.shape)))
    return out


def test_the_dispatch_cache_keeps_argument_structure_and_types(pool):
    results = pool.run(_cache_cases)
    for rows in results:
        bad = [r for r in rows if not r[2]]
        assert not bad, bad
    print(f"cache cases: {len(results[0])} op calls in an order that collided before")


# ---------------------------------------------------------------- rejected arguments
def _rejections(rank, world):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Partial, Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    x = Tensor(np.ones((4, 4), np.float32))
    attempts = {
        "from_local [sum, max]": lambda: DTensor.from_local(x, mesh, [Partial("sum"), Partial("max")]),
        "distribute [max, min]": lambda: distribute_tensor(x, mesh, [Partial("max"), Partial("min")]),
        "redistribute to [sum, max]": lambda: DTensor.from_local(x, mesh, [Partial("sum"), Replicate()])
        .redistribute(mesh, [Partial("sum"), Partial("max")]),
        "avg of int32": lambda: DTensor.from_local(x.astype(ms.int32), mesh, [Partial("avg"), Replicate()]),
    }
    out = {}
    for name, f in attempts.items():
        try:
            f()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_mixed_partials_and_integer_averages_are_rejected_on_every_rank(pool):
    results = pool.run(_rejections)
    assert all(r == results[0] for r in results)
    for name, msg in results[0].items():
        if name.startswith("avg"):
            assert "floating-point" in msg, (name, msg)
        else:
            assert "mix Partial reduce ops" in msg, (name, msg)


def _mixed_partials(rank, world):
    from mindspore import Tensor

    return mixed_partial_case(rank, world, lambda v: Tensor(np.asarray(v, np.float64)), lambda t: t.asnumpy().tolist())


def test_sum_and_avg_partials_mix_with_torchs_numbers(pool):
    """Partial("sum") and Partial("avg") commute, so torch.distributed.tensor accepts them mixed on
    one tensor and between operands; the values must be the float64 reference's."""
    n = check_mixed_partials(pool.run(_mixed_partials))
    print(f"mixed Partial cases: {n} checked over 4 ranks")


# ---------------------------------------------------------------- Python values
def _python_values(rank, world, mesh_shape):
    from mindspore import Tensor

    from hp_dtensor import DTensor, Partial, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    A = np.arange(32, dtype=np.float32).reshape(4, 8) / 4.0
    pl = [Shard(0)] + [Shard(1)] * (len(mesh_shape) - 1)
    x = DTensor.from_local(Tensor(slice_of(A, pl, mesh_shape, coord)), mesh, pl)
    p = DTensor.from_local(Tensor(_partial_terms(A, rank, world)), mesh, [Partial("sum")] * len(mesh_shape))
    s = x.sum()
    return {
        "item": s.item(), "float": float(s), "int": int(s), "bool": bool(s > 0), "partial item": round(p.sum().item(), 3),
        "max item": x.max().item() if hasattr(x, "max") else None,
        "numel": x.numel(), "size": x.size, "nbytes": x.nbytes, "len": len(x), "shape": tuple(x.shape),
        "tolist": x.tolist(), "partial tolist": np.round(np.array(p.tolist()), 4).tolist(),
    }


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_python_values_are_global_and_equal_on_every_rank(pool, mesh_shape):
    A = np.arange(32, dtype=np.float32).reshape(4, 8) / 4.0
    results = pool.run(_python_values, mesh_shape)
    want = {
        "item": float(A.sum()), "float": float(A.sum()), "int": int(A.sum()), "bool": True,
        "partial item": round(float(A.sum()), 3), "max item": float(A.max()),
        "numel": 32, "size": 32, "nbytes": 128, "len": 4, "shape": (4, 8),
        "tolist": A.tolist(), "partial tolist": np.round(A, 4).tolist(),
    }
    for r in results:
        assert r == want, {k: (r[k], want[k]) for k in want if r[k] != want[k]}


# ---------------------------------------------------------------- ops MindSpore runs without __fallback__
def _stack_and_mixing(rank, world):
    from mindspore import Tensor, mint, ops

    from hp_dtensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    A = np.random.RandomState(8).randn(4, 6).astype(np.float32)
    B = np.random.RandomState(9).randn(4, 6).astype(np.float32)
    x = DTensor.from_local(Tensor(np.split(A, world, 0)[rank]), mesh, [Shard(0)])
    y = DTensor.from_local(Tensor(np.split(B, world, 0)[rank]), mesh, [Shard(0)])
    out = {}
    for name, f, want in (
        ("ops.stack axis 0", lambda: ops.stack([x, y]), np.stack([A, B])),
        ("ops.stack axis 1", lambda: ops.stack([x, y], 1), np.stack([A, B], 1)),
        ("ops.stack axis -1", lambda: ops.stack((x, y), -1), np.stack([A, B], -1)),
        ("mint.stack", lambda: mint.stack([x, y]), np.stack([A, B])),
        ("ops.addn", lambda: ops.addn([x, y]), A + B),
    ):
        r = f()
        out[name] = (type(r).__name__, tuple(r.shape), bool(np.allclose(r.full_tensor().asnumpy(), want, atol=1e-6)))
    P = Tensor(A)
    for name, f in (("plain + dtensor", lambda: Tensor(A) + x), ("plain * dtensor", lambda: Tensor(A) * x),
                    ("plain @ dtensor", lambda: Tensor(A.T.copy()) @ x),
                    # function and method forms with the plain tensor first
                    ("ops.add(plain, dt)", lambda: ops.add(P, x)), ("ops.sub(plain, dt)", lambda: ops.sub(P, x)),
                    ("ops.mul(plain, dt)", lambda: ops.mul(P, x)), ("ops.div(plain, dt)", lambda: ops.div(P, x)),
                    ("ops.matmul(plain, dt)", lambda: ops.matmul(Tensor(A.T.copy()), x)),
                    ("mint.add(plain, dt)", lambda: mint.add(P, x)), ("plain.add(dt)", lambda: P.add(x)),
                    ("plain.sub(dt)", lambda: P.sub(x)), ("plain.mul(dt)", lambda: P.mul(x)),
                    ("plain.div(dt)", lambda: P.div(x)), ("plain.matmul(dt)", lambda: Tensor(A.T.copy()).matmul(x)),
                    ("plain ** dt", lambda: P ** x), ("plain % dt", lambda: P % x)):
        try:
            f()
            out[name] = "accepted"
        except RuntimeError as e:
            out[name] = str(e).splitlines()[0]
    # a one-element plain tensor first joins as a replicated scalar: applied once to a Partial
    from hp_dtensor import Partial

    part = DTensor.from_local(Tensor(_partial_terms(A, rank, world)), mesh, [Partial("sum")])
    out["scalar.add(partial)"] = float(np.max(np.abs(Tensor(2.0).add(part).full_tensor().asnumpy() - (2.0 + A))))
    out["scalar.sub(partial)"] = float(np.max(np.abs(Tensor(2.0).sub(part).full_tensor().asnumpy() - (2.0 - A))))
    # plain tensors and Parameters alone still run natively (the hook is invisible to them)
    import mindspore as ms
    from mindspore import nn

    dense = nn.Dense(6, 3)
    w = ms.Parameter(Tensor(B), name="w")
    out["plain only"] = bool(np.allclose((P.add(P) + w * 2).asnumpy(), 2 * A + 2 * B) and dense(P).shape == (4, 3))
    return out


MIXED = ("plain + dtensor", "plain * dtensor", "plain @ dtensor", "ops.add(plain, dt)", "ops.sub(plain, dt)",
         "ops.mul(plain, dt)", "ops.div(plain, dt)", "ops.matmul(plain, dt)", "mint.add(plain, dt)", "plain.add(dt)",
         "plain.sub(dt)", "plain.mul(dt)", "plain.div(dt)", "plain.matmul(dt)", "plain ** dt", "plain % dt")


def test_stack_addn_and_plain_tensor_on_the_left(pool):
    for out in pool.run(_stack_and_mixing):
        for name in ("ops.stack axis 0", "ops.stack axis 1", "ops.stack axis -1", "mint.stack", "ops.addn"):
            kind, shape, ok = out[name]
            assert kind == "DTensor" and ok, (name, out[name])
        assert out["ops.stack axis 0"][1] == (2, 4, 6) and out["ops.stack axis -1"][1] == (4, 6, 2)
        for name in MIXED:
            assert "mix of mindspore.Tensor" in out[name] and "__fallback__" not in out[name], (name, out[name])
        assert out["scalar.add(partial)"] < 1e-5 and out["scalar.sub(partial)"] < 1e-5, out
        assert out["plain only"]
    print(f"plain tensor first: {len(MIXED)} operator/function/method forms give the mixing error on 4 ranks")


# ---------------------------------------------------------------- from_local(run_check=True)
def _run_check_cases(rank, world):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    base = np.arange(8, dtype=np.float32).reshape(2, 4)
    cases = {
        "dtype": Tensor(base).astype(ms.int32 if rank == 1 else ms.float32),
        "ndim": Tensor(base.reshape(2, 4, 1) if rank == 3 else base),
        "shape": Tensor(np.ones((2 + (rank == 2), 4), np.float32)),
        "replicate data": Tensor(base + (rank == 1)),
    }
    out = {}
    for name, t in cases.items():
        try:
            DTensor.from_local(t, mesh, [Shard(0), Replicate()], run_check=True)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    # placements disagree across ranks
    try:
        DTensor.from_local(Tensor(base), mesh, [Shard(0), Replicate() if rank else Shard(1)], run_check=True)
        out["placements"] = "accepted"
    except ValueError as e:
        out["placements"] = str(e)
    # a good call passes, and the communicator still moves the right data afterwards
    mine = Tensor(base + 10 * (rank // 2))
    dt = DTensor.from_local(mine, mesh, [Shard(0), Replicate()], run_check=True)
    out["after"] = dt.full_tensor().asnumpy().tolist()
    return out


def test_from_local_run_check_compares_a_fixed_record(pool):
    base = np.arange(8, dtype=np.float32).reshape(2, 4)
    results = pool.run(_run_check_cases, timeout=60)
    assert all(r == results[0] for r in results)  # the same verdict on every rank
    out = results[0]
    assert "the dtype differs" in out["dtype"] and "rank 1: int32" in out["dtype"] and "rank 0: float32" in out["dtype"]
    assert "the ndim differs" in out["ndim"] and "rank 3: 3" in out["ndim"] and "rank 0: 2" in out["ndim"]
    assert "local shape differs" in out["shape"] and "rank 2: (3, 4)" in out["shape"]
    assert "Replicate() on mesh dim 1" in out["replicate data"] and "rank 1" in out["replicate data"]
    assert "the placements differs" in out["placements"] and "rank 0: [Shard(dim=0), Shard(dim=1)]" in out["placements"]
    assert out["after"] == np.concatenate([base, base + 10]).tolist()


# ---------------------------------------------------------------- Partial("avg") gradients
def _avg_grad(rank, world, mesh_shape):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    G = np.random.RandomState(11).randn(4, 4).astype(np.float32)
    local = Tensor(np.full((4, 4), float(rank + 1), np.float32))
    out = []
    for dst in ([Replicate()] * len(mesh_shape), [Shard(0)] * len(mesh_shape)):
        def loss(xl, dst=dst):
            pl = [Partial("avg")] * len(mesh_shape)
            return (DTensor.from_local(xl, mesh, pl).redistribute(mesh, dst).full_tensor() * Tensor(G)).sum()

        out.append(ms.grad(loss)(local).asnumpy())
    return out


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_partial_avg_source_gradient_matches_torch(pool, mesh_shape):
    """torch.distributed.tensor gives the grad of a Partial("avg") from_local input as the global
    gradient G on every rank (it keeps the replicated gradient instead of re-partialing it)."""
    G = np.random.RandomState(11).randn(4, 4).astype(np.float32)
    for grads in pool.run(_avg_grad, mesh_shape):
        for g in grads:
            np.testing.assert_allclose(g, G, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- random ops
def _dropout_cases(rank, world):
    """Ranks are deliberately seeded differently: the DTensor stream must not care."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh
    from hp_dtensor.api import random_stream

    ms.set_seed(100 + rank)
    mesh = init_device_mesh("cpu", (2, 2))
    A = np.random.RandomState(12).rand(8, 8).astype(np.float32) + 1.0
    G = np.random.RandomState(13).randn(8, 8).astype(np.float32)
    coord = mesh.get_coordinate()
    rep = DTensor.from_local(Tensor(A), mesh, [Replicate(), Replicate()])
    random_stream.manual_seed(1234)
    y_rep = ops.dropout(rep, p=0.25).to_local().asnumpy()
    drop = nn.Dropout(p=0.5)
    drop.set_train(True)
    y_cell = drop(rep).to_local().asnumpy()
    # the same draw on a sharded tensor is the matching slice of the replicated one
    random_stream.manual_seed(1234)
    sh = DTensor.from_local(Tensor(slice_of(A, (Shard(0), Shard(1)), (2, 2), coord)), mesh, [Shard(0), Shard(1)])
    y_sh = ops.dropout(sh, p=0.25).full_tensor().asnumpy()

    def loss(xl):
        x = DTensor.from_local(xl, mesh, [Replicate(), Replicate()])
        return (ops.dropout(x, p=0.25).full_tensor() * Tensor(G)).sum()

    random_stream.manual_seed(1234)
    grad = ms.grad(loss)(Tensor(A)).asnumpy()
    return y_rep, y_cell, y_sh, grad


def test_dropout_on_replicated_dtensors_agrees_across_ranks(pool):
    A = np.random.RandomState(12).rand(8, 8).astype(np.float32) + 1.0
    G = np.random.RandomState(13).randn(8, 8).astype(np.float32)
    results = pool.run(_dropout_cases)
    y_rep, y_cell = results[0][0], results[0][1]
    for r_rep, r_cell, r_sh, grad in results:
        np.testing.assert_array_equal(r_rep, y_rep)  # identical on every rank
        np.testing.assert_array_equal(r_cell, y_cell)
        np.testing.assert_array_equal(r_sh, y_rep)  # sharded = slice of the same draw
        kept = y_rep != 0
        np.testing.assert_allclose(y_rep[kept], A[kept] / 0.75, rtol=1e-6)
        # the gradient uses the same mask as the forward (one variable replicated: mask * G / keep)
        np.testing.assert_allclose(grad, kept * G / 0.75, rtol=1e-5, atol=1e-5)
    assert 0.5 < (y_rep != 0).mean() < 0.95 and 0.2 < (y_cell != 0).mean() < 0.8


def _manual_seed_cases(rank, world, case):
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Replicate, init_device_mesh, manual_seed
    from hp_dtensor.api import random_stream

    mesh = init_device_mesh("cpu", (2, 2))
    if case == "different":
        manual_seed(7 + (rank == 3), mesh)
        return None
    A = np.ones((8, 8), np.float32)
    rep = DTensor.from_local(Tensor(A), mesh, [Replicate(), Replicate()])
    manual_seed(2**64 - 5, mesh)
    via_api = ops.dropout(rep, p=0.5).to_local().asnumpy()
    random_stream.manual_seed(2**64 - 5)
    via_stream = ops.dropout(rep, p=0.5).to_local().asnumpy()
    return via_api, via_stream


def test_manual_seed_seeds_the_dtensor_stream_and_checks_ranks_agree(pool):
    from hp_dtensor.testing import RankError

    results = pool.run(_manual_seed_cases, "same")
    for via_api, via_stream in results:
        np.testing.assert_array_equal(via_api, via_stream)
        np.testing.assert_array_equal(via_api, results[0][0])
    with pytest.raises(RankError) as info:
        pool.run(_manual_seed_cases, "different", timeout=60)
    msg = str(info.value)
    assert "raised on ranks [0, 1, 2, 3]" in msg and msg.count("rank 3: 8") == 4


# ---------------------------------------------------------------- random ops other than dropout
RANDOM_OPS = ("ops.rand_like", "ops.randn_like", "mint.rand_like", "mint.randn_like", "mint.rand_like f16",
              "uniform_(2, 5)", "normal_(1, 2)", "mint dropout", "random_ops.randn_like")
# like-ops read a Partial as Replicate; fills keep placements (a Partial("sum") holds the draw once)
RANDOM_LAYOUTS = ("RR", "S0S1", "S1S0", "RS1", "S0R", "PR", "PP")


def _layout(code):
    from hp_dtensor import Partial, Replicate, Shard

    out, i = [], 0
    while i < len(code):
        c = code[i]
        if c == "S":
            out.append(Shard(int(code[i + 1])))
            i += 2
        else:
            out.append(Replicate() if c == "R" else Partial("sum"))
            i += 1
    return tuple(out)


def _random_op(name, x):
    import mindspore as ms
    from mindspore import mint, ops

    if name == "ops.rand_like":
        return ops.rand_like(x)
    if name == "ops.randn_like":
        return ops.randn_like(x)
    if name == "mint.rand_like":
        return mint.rand_like(x)
    if name == "mint.randn_like":
        return mint.randn_like(x)
    if name == "mint.rand_like f16":
        return mint.rand_like(x, dtype=ms.float16)
    if name == "uniform_(2, 5)":
        return x.uniform_(2.0, 5.0)
    if name == "normal_(1, 2)":
        return x.normal_(1.0, 2.0)
    if name == "mint dropout":
        return mint.nn.functional.dropout(x, 0.4, training=True)
    if name == "random_ops.randn_like":  # the entry point that works whatever was imported first
        from hp_dtensor.platform.mindspore import random_ops

        return random_ops.randn_like(x)
    raise AssertionError(name)


def _random_input(shape):
    return np.random.RandomState(21).rand(*shape).astype(np.float32) + 1.0


def _random_cases(rank, world, shapes):
    """Every op on every layout after the same stream seed, with the ranks' own generators seeded
    differently on purpose: the full result of each, plus a type/placement verdict."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, init_device_mesh
    from hp_dtensor.api import random_stream
    from hp_dtensor.layout.shard_geometry import local_shape_and_offset as geom

    ms.set_seed(100 + rank)
    np.random.seed(100 + rank)
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    out = {}
    for shape in shapes:
        A = _random_input(shape)
        for code in RANDOM_LAYOUTS:
            pl = _layout(code)
            if "P" in code:
                n_terms = sum(isinstance(p, type(pl[0])) and p.is_partial() for p in pl)
                local = A / (2 ** n_terms)  # exact terms: every rank holds the same one
            else:
                lshape, start = geom(shape, (2, 2), pl, coord)
                local = A[tuple(slice(o, o + n) for o, n in zip(start, lshape))]
            for name in RANDOM_OPS:
                random_stream.manual_seed(77)
                x = DTensor.from_local(Tensor(np.ascontiguousarray(local)), mesh, pl, shape=shape)
                r = _random_op(name, x)
                want_pl = pl if name.startswith(("uniform_", "normal_", "mint dropout")) else tuple(
                    _layout("R")[0] if p.is_partial() else p for p in pl)
                if name == "mint dropout":
                    want_pl = tuple(_layout("R")[0] if p.is_partial() else p for p in pl)
                verdict = (type(r).__name__, tuple(r.placements) == want_pl, tuple(r.shape) == tuple(shape))
                out[(shape, code, name)] = (verdict, str(r.dtype), r.full_tensor().astype(ms.float32).asnumpy())
    return out


def _one_process_random(shapes):
    """The same ops on a one-process mesh (this test process, a world of one): the reference."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import DTensor, Replicate, init_device_mesh
    from hp_dtensor.api import random_stream

    mesh = init_device_mesh("cpu", (1,))
    ref = {}
    for shape in shapes:
        for name in RANDOM_OPS:
            random_stream.manual_seed(77)
            x = DTensor.from_local(Tensor(_random_input(shape)), mesh, [Replicate()])
            r = _random_op(name, x)
            ref[(shape, name)] = (str(r.dtype), r.to_local().astype(ms.float32).asnumpy())
    return ref


RANDOM_SHAPES = [(8, 6), (4, 4, 2), (7, 5), (3, 1)]  # the last two shard unevenly, (3, 1) to size 0


def test_random_ops_on_dtensors_are_the_one_process_draw(pool):
    """Replicated results equal on every rank, sharded results the slice of the one-process draw,
    bit for bit, for every op x layout x shape; the ranks' own generators are seeded apart."""
    results = pool.run(_random_cases, RANDOM_SHAPES)
    ref = _one_process_random(RANDOM_SHAPES)
    cases = mismatches = 0
    bad = []
    for rank, out in enumerate(results):
        for (shape, code, name), (verdict, dtype, full) in out.items():
            cases += 1
            want_dtype, want = ref[(shape, name)]
            if verdict != ("DTensor", True, True) or dtype != want_dtype or not np.array_equal(full, want):
                mismatches += 1
                bad.append((rank, shape, code, name, verdict, dtype, want_dtype))
    print(f"random ops vs one process: {cases} op x layout x shape x rank cases "
          f"({len(RANDOM_OPS)} ops, {len(RANDOM_LAYOUTS)} layouts, {len(RANDOM_SHAPES)} shapes), {mismatches} mismatches")
    # the draws are what they claim to be (on the shapes with enough elements to tell)
    for (_shape, name), (_, v) in ref.items():
        if v.size < 30:
            continue
        if name == "uniform_(2, 5)":
            assert 2.0 <= v.min() and v.max() < 5.0 and abs(v.mean() - 3.5) < 0.5
        elif name == "normal_(1, 2)":
            assert abs(v.mean() - 1.0) < 0.8 and 1.2 < v.std() < 2.8
        elif "randn" in name:
            assert abs(v.mean()) < 0.5 and 0.6 < v.std() < 1.4
        elif "rand" in name:
            assert 0.0 <= v.min() and v.max() < 1.0
    assert not bad, bad[:10]


def _random_refusals(rank, world):
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Replicate, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    x = DTensor.from_local(Tensor(np.ones((4, 4), np.float32)), mesh, [Replicate(), Replicate()])
    attempts = {
        "ops.bernoulli": lambda: ops.bernoulli(x, 0.5),
        "ops.multinomial": lambda: ops.multinomial(x, 1),
        "ops.shuffle": lambda: ops.shuffle(x),
        "random_": lambda: x.random_(0, 5),
        "exponential_": lambda: x.exponential_(),
        "ops.rand_like(seed=)": lambda: ops.rand_like(x, seed=3),
        "mint.rand_like(int32)": lambda: ops.rand_like(x, dtype=ms.int32),
    }
    out = {}
    for name, f in attempts.items():
        try:
            r = f()
            out[name] = f"accepted: {type(r).__name__}"
        except (NotImplementedError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_random_ops_without_dtensor_semantics_refuse_on_every_rank(pool):
    results = pool.run(_random_refusals)
    assert all(r == results[0] for r in results)
    for name, msg in results[0].items():
        if name == "ops.rand_like(seed=)":
            assert msg.startswith("ValueError") and "manual_seed" in msg, msg
        elif name == "mint.rand_like(int32)":
            assert msg.startswith("ValueError") and "floating-point" in msg, msg
        else:
            assert msg.startswith("NotImplementedError") and "differ across ranks" in msg, (name, msg)


# ---------------------------------------------------------------- initializers on DTensor parameters
INIT_LAYOUTS = ("RR", "S0S1", "S1R")


def _init_cases(rank, world, shape):
    """MindSpore's initializers on DTensor parameters, ranks' numpy states seeded apart: rank 0's
    draw is what every rank ends up with, laid out by the parameter's placements."""
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.common.initializer import HeUniform, Normal, initializer

    from hp_dtensor import distribute_tensor, init_device_mesh
    from hp_dtensor.platform import current

    mesh = init_device_mesh("cpu", (2, 2))
    out = {}
    for code in INIT_LAYOUTS:
        pl = _layout(code)
        np.random.seed(300 + rank)
        p = ms.Parameter(distribute_tensor(Tensor(np.zeros(shape, np.float32)), mesh, pl), name="w")
        p.set_data(initializer(Normal(0.02), shape, ms.float32))
        out[(code, "set_data(Normal)")] = (type(p).__name__, p.full_tensor().asnumpy())
        p.set_data(initializer(HeUniform(), shape, ms.float32))
        out[(code, "set_data(HeUniform)")] = (type(p).__name__, p.full_tensor().asnumpy())
        np.random.seed(400 + rank)
        current().init_param_(p, "normal", 0.5)
        out[(code, "init_param_ normal")] = (type(p).__name__, p.full_tensor().asnumpy())
        np.random.seed(500 + rank)
        d = distribute_tensor(initializer(Normal(0.02), shape, ms.float32), mesh, pl)
        out[(code, "distribute_tensor(lazy)")] = (type(d).__name__, d.full_tensor().asnumpy())
    try:
        p.set_data(Tensor(np.zeros((2, 2), np.float32)))
        out["wrong shape"] = "accepted"
    except ValueError as e:
        out["wrong shape"] = str(e)
    return out


def test_initializers_on_dtensor_parameters_are_the_one_process_init(pool):
    import mindspore as ms
    from mindspore.common.initializer import HeUniform, Normal, initializer

    shape = (8, 6)

    def one_process(seed, make):
        np.random.seed(seed)
        return make()

    normal = lambda: initializer(Normal(0.02), shape, ms.float32).init_data().asnumpy()  # noqa: E731
    ref = {"set_data(Normal)": one_process(300, normal)}
    ref["set_data(HeUniform)"] = initializer(HeUniform(), shape, ms.float32).init_data().asnumpy()  # continues 300
    ref["init_param_ normal"] = one_process(
        400, lambda: initializer(Normal(sigma=0.5, mean=0.0), shape, ms.float32).init_data().asnumpy())
    ref["distribute_tensor(lazy)"] = one_process(500, normal)
    results = pool.run(_init_cases, shape)
    cases = 0
    for out in results:
        msg = out.pop("wrong shape")
        assert "global shape (8, 6)" in msg and "(2, 2)" in msg, msg
        for (code, name), (kind, full) in out.items():
            cases += 1
            assert kind in ("ParameterDTensor", "DTensor"), (code, name, kind)
            np.testing.assert_array_equal(full, ref[name], err_msg=f"{code} {name}")
    print(f"initializers on DTensor parameters: {cases} cases bit-equal to one process (rank 0's numpy seed)")


TO_LOCAL_LAYOUTS = ("RR", "S0R", "RS1", "S0S1", "S1S0")


def _parameter_to_local_cases(rank, world):
    """``to_local`` of a DTensor Parameter and its gradient, in float32 and bfloat16, on every
    layout of a 2x2 mesh (3 columns: uneven on the mesh dim that splits them)."""
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    A = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = {}
    for dt in ("float32", "bfloat16"):
        for code in TO_LOCAL_LAYOUTS:
            p = ms.Parameter(distribute_tensor(Tensor(A).astype(getattr(ms, dt)), mesh, _layout(code)), name="w")
            local = p.to_local()
            grad = ms.grad(lambda p=p: (p.to_local().astype(ms.float32) * Tensor(3.0)).sum(), grad_position=None,
                           weights=[p])()[0]
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            out[(dt, code)] = (type(local).__name__, str(local.dtype), local.astype(ms.float32).asnumpy(),
                               grad.astype(ms.float32).asnumpy())
    return out


def test_parameter_to_local_in_bfloat16_is_float32s_shard_and_gradient(pool):
    # MindSpore's CPU Identity kernel, which links a Parameter's local tensor to it, has no bfloat16:
    # to_local of a bfloat16 DTensor Parameter raised
    cases = 0
    for out in pool.run(_parameter_to_local_cases):
        for (dt, code), (kind, dtype, local, grad) in out.items():
            want = out[("float32", code)]
            assert kind == "Tensor" and dtype == {"float32": "Float32", "bfloat16": "BFloat16"}[dt], (dt, code)
            np.testing.assert_array_equal(local, want[2], err_msg=f"{dt} {code} shard")
            np.testing.assert_array_equal(grad, want[3], err_msg=f"{dt} {code} gradient")
            np.testing.assert_array_equal(grad, np.full_like(local, 3.0), err_msg=f"{dt} {code} gradient value")
            cases += 1
    print(f"Parameter.to_local: {cases} cases (4 ranks x 2 dtypes x {len(TO_LOCAL_LAYOUTS)} layouts), bfloat16 equal "
          f"to float32")
