# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Gradient-norm clipping across meshes and layouts, on 2 and 4 gloo ranks, against
``torch.nn.utils.clip_grad_norm_`` on the whole tensors in float64 in one process.

Generated seeded cases mix plain tensors with DTensors on 1-D and 2-D meshes (FSDP's Shard(0),
TP's Shard/Replicate, both, Partial gradients, uneven and empty shards, float32 and float64),
norm orders 2, 1, 3, inf, -inf, 0.5, 0 and -1, NaN and inf gradients, None gradients, the three
entry points and every ``foreach``; every rank must return the same total, bit for bit, and
hold the slice of torch's clipped gradient.  Real ``fully_shard`` modules (FSDP, and TP + FSDP on
a (dp, tp) mesh) are clipped after a backward and compared with the one-process module.
"""

from __future__ import annotations

import math
import random
import struct
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=120)
pool4 = rank_pool_fixture(4, timeout=120)

NORMS = (2.0, 1.0, 3.0, math.inf, -math.inf, 0.5, 0.0, -1.0)
TOL = {torch.float64: (1e-9, 1e-12), torch.float32: (2e-5, 1e-6)}
CASES = {2: 240, 4: 160}


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    from hp_dtensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _meshes(world: int) -> list[tuple[str, Any]]:
    """(label, mesh) pairs a generated parameter may live on."""
    from hp_dtensor import init_device_mesh

    if world == 2:
        return [
            ("dp", init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))),
            ("tp", init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))),
            ("1x2", init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))),
            ("2x1", init_device_mesh("cpu", (2, 1), mesh_dim_names=("c", "d"))),
        ]
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return [
        ("dp", root["dp"]),
        ("tp", root["tp"]),
        ("dp,tp", root),
        ("tp,dp", root["tp", "dp"]),  # how fully_shard lays out a TP parameter: TP dims first
        ("world", init_device_mesh("cpu", (4,), mesh_dim_names=("w",))),
        ("unnamed", init_device_mesh("cpu", (2, 2))),
    ]


def _placements(rng: random.Random, ndim: int, mesh: Any) -> tuple[Any, ...]:
    from hp_dtensor import Partial, Replicate, Shard

    out = []
    for _ in range(mesh.ndim):
        r = rng.random()
        if ndim and r < 0.55:
            out.append(Shard(rng.randrange(ndim)))
        elif r < 0.8:
            out.append(Replicate())
        else:
            out.append(Partial(rng.choice(["sum", "avg"])))
    return tuple(out)


def _shard(full: torch.Tensor, mesh: Any, placements: tuple[Any, ...], gen: torch.Generator) -> torch.Tensor:
    """This rank's local data of ``full`` laid out by ``placements``; a Partial dim holds
    ``full / n`` (sum) or ``full`` (avg) plus noise that cancels over the dim."""
    from hp_dtensor import Replicate, distribute_tensor

    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(full, mesh, base, src_data_rank=None).to_local().clone()
    coord = mesh.get_coordinate()
    for k, p in enumerate(placements):
        if not p.is_partial():
            continue
        n = mesh.size(k)
        if p.reduce_op == "sum":
            local = local / n
        noise = [torch.randn(full.shape, generator=gen, dtype=torch.float64) for _ in range(n - 1)]
        noise.append(-sum(noise) if noise else torch.zeros(full.shape, dtype=torch.float64))
        mine = distribute_tensor(noise[coord[k]].to(full.dtype), mesh, base, src_data_rank=None).to_local()
        local = local + mine
    return local.contiguous()


def _gen_case(rng: random.Random, meshes: list[tuple[str, Any]]) -> dict[str, Any]:
    nparams = rng.randint(1, 6)
    mode = rng.random()  # all float64, all float32, or a mix (the total takes the promoted dtype)
    dtypes = [torch.float32 if (mode < 0.2 or (mode < 0.35 and rng.random() < 0.5)) else torch.float64
              for _ in range(nparams)]
    params: list[dict[str, Any]] = []
    for _ in range(nparams):
        ndim = rng.choice([0, 1, 1, 2, 2, 2, 3])
        shape = tuple(rng.choice([1, 2, 3, 4, 5, 7, 9]) for _ in range(ndim))
        if rng.random() < 0.15:
            params.append({"shape": shape, "mesh": None, "placements": None, "dtype": dtypes[len(params)]})
            continue
        label, mesh = rng.choice(meshes)
        params.append({"shape": shape, "mesh": label, "placements": _placements(rng, ndim, mesh),
                       "none": rng.random() < 0.1, "dtype": dtypes[len(params)]})
    bad = None
    if rng.random() < 0.15:
        bad = (rng.randrange(nparams), rng.random(), rng.choice([math.nan, math.inf, -math.inf]))
    return {
        "params": params, "p": rng.choice(NORMS), "bad": bad,
        "api": rng.choice(["clip", "clip", "split"]), "foreach": rng.choice([None, True, False]),
        "error_if_nonfinite": rng.random() < 0.5, "max_factor": rng.choice([0.3, 0.7, 1.0, 1.5, 4.0]),
    }


def _one_case(seed: int, meshes: list[tuple[str, Any]]) -> dict[str, Any]:
    """Run one generated case; raise AssertionError naming the seed on any mismatch."""
    import hp_fsdp
    from hp_dtensor import DTensor, Replicate, distribute_tensor

    rng = random.Random(seed)
    case = _gen_case(rng, meshes)
    by_label = dict(meshes)
    gen = torch.Generator().manual_seed(seed)
    p = case["p"]
    dtypes = {spec["dtype"] for spec in case["params"]}
    ours, ref, info = [], [], []
    for i, spec in enumerate(case["params"]):
        dtype = spec["dtype"]
        full = torch.randn(spec["shape"], generator=gen, dtype=torch.float64).to(dtype)
        if case["bad"] is not None and case["bad"][0] == i and full.numel():
            full.view(-1)[int(case["bad"][1] * full.numel())] = case["bad"][2]
        rp = nn.Parameter(torch.zeros(spec["shape"], dtype=torch.float64))
        rp.grad = full.to(torch.float64)
        if spec["mesh"] is None:
            op = nn.Parameter(torch.zeros(spec["shape"], dtype=dtype))
            op.grad = full.clone()
            kind = "plain"
        else:
            mesh, pl = by_label[spec["mesh"]], spec["placements"]
            local = _shard(full, mesh, pl, gen)
            grad = DTensor.from_local(local, mesh, pl, shape=full.shape)
            op = nn.Parameter(distribute_tensor(
                torch.zeros(spec["shape"], dtype=dtype), mesh,
                [Replicate() if x.is_partial() else x for x in pl], src_data_rank=None,
            ))
            kind = "partial" if any(x.is_partial() for x in pl) else f"{spec['mesh']}"
            if spec.get("none"):
                rp.grad = None
            else:
                op.grad = grad
        ours.append(op)
        ref.append(rp)
        info.append(kind)

    # torch on the whole tensors, float64, one process
    ref_total = torch.nn.utils.get_total_norm([x.grad for x in ref if x.grad is not None], p)
    finite = bool(torch.isfinite(ref_total))
    max_norm = float(ref_total) * case["max_factor"] if finite and float(ref_total) > 0 else 1.0
    err = case["error_if_nonfinite"]
    ref_msg = None
    try:
        torch.nn.utils.clip_grad_norm_(ref, max_norm, p, error_if_nonfinite=err)
    except RuntimeError as e:
        ref_msg = str(e)

    before = [None if x.grad is None else _local(x.grad).clone() for x in ours]
    msg = None
    try:
        if case["api"] == "clip":
            total = hp_fsdp.clip_grad_norm_(ours, max_norm, p, error_if_nonfinite=err, foreach=case["foreach"])
        else:
            total = hp_fsdp.get_total_norm([x.grad for x in ours if x.grad is not None], p, err, case["foreach"])
            hp_fsdp.clip_grads_with_norm_(ours, max_norm, total, case["foreach"])
    except RuntimeError as e:
        msg = str(e)
    where = f"seed {seed}: {case} ({info})"
    assert msg == ref_msg, f"{where}: error {msg!r} vs torch {ref_msg!r}"
    rtol, atol = TOL[torch.float32 if torch.float32 in dtypes else torch.float64]
    if msg is None:
        assert not isinstance(total, DTensor) and total.ndim == 0, where
        torch.testing.assert_close(total.double(), ref_total.double(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{where}: total: {m}")
    for i, (op, rp, b) in enumerate(zip(ours, ref, before)):
        if op.grad is None:
            assert rp.grad is None, where
            continue
        if msg is not None:  # torch raised before touching a gradient: so must we
            torch.testing.assert_close(_local(op.grad), b, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, i=i: f"{where}: grad {i} changed although clipping raised: {m}")
            continue
        if isinstance(op.grad, DTensor) and any(x.is_partial() for x in op.grad.placements):
            got, want = op.grad.full_tensor(), rp.grad  # the summands scaled: their sum is torch's
        elif isinstance(op.grad, DTensor):
            got = _local(op.grad)  # this rank's slice of torch's clipped gradient, no communication
            want = distribute_tensor(rp.grad, op.grad.device_mesh, op.grad.placements, src_data_rank=None).to_local()
        else:
            got, want = op.grad, rp.grad
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, i=i: f"{where}: grad {i}: {m}")
    return {
        "p": p, "kinds": sorted(set(info)), "nonfinite": not finite, "raised": msg is not None,
        "total_bits": None if msg is not None else _bits(float(total)), "msg": msg,
        "clipped": finite and case["max_factor"] < 1.0, "dtypes": sorted(map(str, dtypes)), "api": case["api"],
    }


def _generated(rank: int, world: int, seeds: list[int]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    meshes = _meshes(world)
    return [_one_case(s, meshes) for s in seeds]


def _check_generated(results: list[list[dict[str, Any]]], world: int) -> None:
    n = len(results[0])
    for i in range(n):
        assert len({r[i]["total_bits"] for r in results}) == 1, ("ranks disagree on the total", i, [r[i] for r in results])
        assert len({r[i]["msg"] for r in results}) == 1, ("ranks disagree on the error", i)
    cases = results[0]
    kinds = Counter(k for c in cases for k in c["kinds"])
    norms = Counter(c["p"] for c in cases)
    summary = (
        f"{world} ranks: {n} generated cases; norms {dict(norms)}; layouts {dict(kinds)}; "
        f"nonfinite {sum(c['nonfinite'] for c in cases)} (raised {sum(c['raised'] for c in cases)}); "
        f"clipped {sum(c['clipped'] for c in cases)}; float32 {sum('torch.float32' in c['dtypes'] for c in cases)} "
        f"(mixed with float64 {sum(len(c['dtypes']) == 2 for c in cases)}); "
        f"split api {sum(c['api'] == 'split' for c in cases)}"
    )
    print(summary)
    assert set(norms) == set(NORMS), summary
    assert sum(c["raised"] for c in cases) >= 5 and sum(c["nonfinite"] and not c["raised"] for c in cases) >= 5, summary
    assert kinds["partial"] >= 20 and kinds["plain"] >= 20, summary


def test_generated_cases_2_ranks(pool2: RankPool) -> None:
    _check_generated(pool2.run(_generated, list(range(CASES[2]))), 2)


def test_generated_cases_4_ranks(pool4: RankPool) -> None:
    _check_generated(pool4.run(_generated, list(range(1000, 1000 + CASES[4]))), 4)


# ----- NaN and inf in one rank's shard: every rank sees them -----

def _nonfinite_on_each_rank(rank: int, world: int) -> list[tuple[Any, ...]]:
    """A NaN (or inf) in the data of one rank at a time -- in a Shard(0) gradient's shard, or in
    one summand of a Partial gradient -- under norms whose reduction is a max, a min or a sum:
    gloo's own float MAX/MIN keep a NaN only when rank 0 holds it."""
    import hp_fsdp
    from hp_dtensor import DTensor, Partial, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("w",))
    out = []
    for owner in range(world):
        for which in ("shard", "partial"):
            for bad in (math.nan, math.inf):
                for p in (math.inf, -math.inf, 2.0, 1.0):
                    for err in (False, True):
                        gen = torch.Generator().manual_seed(owner)
                        # 2w-1 rows: every rank holds rows (the last one a single row); row 2*owner is owner's
                        full = torch.randn(2 * world - 1, 3, generator=gen, dtype=torch.float64)
                        if which == "shard":
                            full[2 * owner, 1] = bad
                            local = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local().clone()
                            pl: list[Any] = [Shard(0)]
                        else:  # rank r holds full/w, ``owner`` has the bad value in one element
                            local = full / world
                            if rank == owner:
                                local[1, 2] = bad
                            full[1, 2] = bad
                            pl = [Partial("sum")]
                        param = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)],
                                                               src_data_rank=None))
                        param.grad = DTensor.from_local(local, mesh, pl, shape=full.shape)
                        want = float(torch.nn.utils.get_total_norm([full], p))
                        msg = None
                        try:
                            total = float(hp_fsdp.clip_grad_norm_([param], 1.0, p, error_if_nonfinite=err))
                        except RuntimeError as e:
                            total, msg = math.nan, str(e)
                        out.append((owner, which, repr(bad), p, err, repr(want), repr(total), msg))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_nonfinite_in_one_shard_reaches_every_rank(pool2: RankPool, pool4: RankPool, world: int) -> None:
    results = (pool2 if world == 2 else pool4).run(_nonfinite_on_each_rank)
    assert all(r == results[0] for r in results), "ranks disagree on a total or an error"
    n_raised = 0
    for case in results[0]:
        _owner, _which, _bad, p, err, want_s, total, msg = case
        want = float(want_s)
        if err and not math.isfinite(want):
            n_raised += 1
            assert msg is not None and msg.startswith(f"The total norm of order {p} for gradients"), case
        else:
            assert msg is None, case
            assert total == want_s or math.isclose(float(total), want, rel_tol=1e-12), case
    print(f"{world} ranks: {len(results[0])} NaN/inf placements, {n_raised} raised on every rank")
    # with error_if_nonfinite: nan under all 4 norms, inf under inf, 2 and 1 (-inf stays finite)
    assert n_raised == world * 2 * 7, n_raised


# ----- real fully_shard modules -----

class _MLP(nn.Module):
    """Uneven rows everywhere: 7 and 3 do not divide by 2 or 4."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


class _TPNet(nn.Module):
    """``up`` column-parallel and ``down`` row-parallel over the TP mesh (when their weights are
    TP DTensors), ``head`` a plain layer: after fully_shard the parameters live on (tp, dp) and on
    dp, with Shard, Replicate and uneven rows."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 6)
        self.down = nn.Linear(6, 3)
        self.head = nn.Linear(3, 3)
        self.tp_mesh: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            h = self.down(torch.tanh(self.up(x)))
        else:
            from hp_dtensor import DTensor, Replicate

            xd = DTensor.from_local(x, self.tp_mesh, [Replicate()])
            hd = torch.tanh(nn.functional.linear(xd, self.up.weight, self.up.bias))  # Shard(-1)
            yd = nn.functional.linear(hd, self.down.weight)  # Partial
            h = yd.redistribute(self.tp_mesh, [Replicate()]).to_local() + self.down.bias.to_local()
        return self.head(h)


def _fully_sharded(rank: int, world: int, kind: str) -> list[dict[str, Any]]:
    """Forward/backward a fully_shard'ed module on this rank's slice of a batch, clip, compare with
    torch's clip_grad_norm_ on the one-process module (float64, same weights, whole batch)."""
    import copy

    import hp_fsdp
    from hp_dtensor import CommDebugMode, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

    torch.manual_seed(7)
    if kind == "fsdp":
        ref = _MLP().double()
        model = copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        dp, dp_rank = world, rank
        hp_fsdp.fully_shard(model.inp, mesh=mesh)
        hp_fsdp.fully_shard(model, mesh=mesh)
    else:  # TP + FSDP on (dp, tp)
        ref = _TPNet().double()
        model = copy.deepcopy(ref)
        root = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp = root["tp"]
        for mod, name, pl in ((model.up, "weight", Shard(0)), (model.up, "bias", Shard(0)),
                              (model.down, "weight", Shard(1)), (model.down, "bias", Replicate())):
            setattr(mod, name, nn.Parameter(distribute_tensor(getattr(mod, name).detach(), tp, [pl])))
        model.tp_mesh = tp
        dp, dp_rank = world // 2, root.get_local_rank("dp")
        hp_fsdp.fully_shard(model, mesh=root["dp"])
    gen = torch.Generator().manual_seed(11)
    out = []
    for p in (2.0, math.inf, 1.0):
        x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
        y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
        model.zero_grad()
        ref.zero_grad()
        ((model(x.chunk(dp)[dp_rank]) - y.chunk(dp)[dp_rank]) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        ref_total = float(torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()], p))
        max_norm = 0.5 * ref_total
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, p)
        with CommDebugMode() as comm:
            total = hp_fsdp.clip_grad_norm_(model.parameters(), max_norm, p)
        worst = 0.0
        for q, rq in zip(model.parameters(), ref.parameters()):
            g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            torch.testing.assert_close(g, rq.grad, rtol=1e-9, atol=1e-12)
            worst = max(worst, float((g - rq.grad).abs().max()))
        torch.testing.assert_close(float(total), ref_total, rtol=1e-12, atol=0)
        out.append({
            "p": p, "total": _bits(float(total)), "ref_total": ref_total, "worst": worst,
            "comms": dict(comm.get_comm_counts()),
            "layouts": sorted({(q.device_mesh.mesh_dim_names, tuple(map(str, q.placements)))
                               for q in model.parameters()}),
        })
    return out


def test_clip_fully_shard_fsdp_2_ranks(pool2: RankPool) -> None:
    results = pool2.run(_fully_sharded, "fsdp")
    for i in range(len(results[0])):
        assert len({r[i]["total"] for r in results}) == 1
    for case in results[0]:
        assert case["layouts"] == [(("dp",), ("S(0)",))], case["layouts"]
        # every parameter is Shard(0) over dp: one reduction of all partial norms
        assert case["comms"] == {"all_reduce": 1}, case["comms"]
    print("fsdp 2 ranks:", [(c["p"], c["ref_total"], c["worst"]) for c in results[0]])


def test_C15_clip_fully_shard_tp_fsdp_4_ranks(pool4: RankPool) -> None:
    results = pool4.run(_fully_sharded, "tp_fsdp")
    for i in range(len(results[0])):
        assert len({r[i]["total"] for r in results}) == 1
    for case in results[0]:
        assert case["layouts"] == [
            (("dp",), ("S(0)",)), (("tp", "dp"), ("R", "S(0)")), (("tp", "dp"), ("S(0)", "S(0)")),
            (("tp", "dp"), ("S(1)", "S(0)")),
        ], case["layouts"]
        # head and the Replicate-on-tp bias reduce over dp together (1); the TP-sharded weights
        # and bias over tp and dp (1 each)
        assert case["comms"] == {"all_reduce": 3}, case["comms"]
    print("tp+fsdp 4 ranks:", [(c["p"], c["ref_total"], c["worst"]) for c in results[0]])


# ----- one process: plain tensors and bad arguments -----

def _plain(seed: int, dtype: torch.dtype = torch.float64) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in ((3, 4), (5,), (), (2, 1, 3)):
        q = nn.Parameter(torch.zeros(shape, dtype=dtype))
        q.grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        params.append(q)
    params[1].grad = None
    return params


@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_plain_tensors_match_torch(p: float, dtype: torch.dtype) -> None:
    import hp_fsdp

    ours, ref = _plain(3, dtype), _plain(3, dtype)
    total = hp_fsdp.clip_grad_norm_(ours, 0.5, p)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, p)
    assert total.dtype == want.dtype and total.shape == ()
    # torch combines the per-tensor norms in the tensors' dtype, ours in float64
    rtol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(total, want, rtol=rtol, atol=0)
    for q, r in zip(ours, ref):
        assert (q.grad is None) == (r.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(q.grad, r.grad, rtol=rtol, atol=0)


def test_no_gradients() -> None:
    import hp_fsdp

    assert float(hp_fsdp.clip_grad_norm_([nn.Parameter(torch.zeros(3))], 1.0)) == 0.0
    assert float(hp_fsdp.get_total_norm([])) == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        none: list[nn.Parameter] = []
        hp_fsdp.clip_grad_norm_((q for q in none), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hp_fsdp.clip_grad_norm_([], 1.0)  # a list is not a generator: no warning, as torch


def test_single_tensor_and_split_api() -> None:
    import hp_fsdp

    q, r = _plain(5)[0], _plain(5)[0]
    total = hp_fsdp.get_total_norm(q.grad, 3.0)
    torch.testing.assert_close(total, torch.nn.utils.get_total_norm(r.grad, 3.0))
    hp_fsdp.clip_grads_with_norm_(q, 0.1, total)
    torch.nn.utils.clip_grads_with_norm_(r, 0.1, total)
    torch.testing.assert_close(q.grad, r.grad)


def test_bad_arguments_fail_loudly() -> None:
    import hp_fsdp

    params = _plain(1)
    with pytest.raises(ValueError, match="max_norm must be >= 0, got -1.0"):
        hp_fsdp.clip_grad_norm_(params, -1.0)
    with pytest.raises(ValueError, match="max_norm must be >= 0, got nan"):
        hp_fsdp.clip_grad_norm_(params, math.nan)
    with pytest.raises(TypeError, match="max_norm must be a number, got 'big'"):
        hp_fsdp.clip_grad_norm_(params, "big")
    with pytest.raises(TypeError, match="norm_type must be a number"):
        hp_fsdp.clip_grad_norm_(params, 1.0, "fro")
    with pytest.raises(ValueError, match="norm_type is NaN"):
        hp_fsdp.get_total_norm([params[0].grad], math.nan)
    with pytest.raises(TypeError, match=r"parameters\[1\] is a float, not a tensor"):
        hp_fsdp.clip_grad_norm_([params[0], 1.0], 1.0)
    with pytest.raises(TypeError, match="must be a tensor or an iterable of tensors, got int"):
        hp_fsdp.get_total_norm(3)
    with pytest.raises(TypeError, match="tensor 0 is a Tensor of shape \\(3,\\) and dtype torch.int64"):
        hp_fsdp.get_total_norm([torch.arange(3)])
    with pytest.raises(TypeError, match="total_norm must be the tensor get_total_norm returned, got float"):
        hp_fsdp.clip_grads_with_norm_(params, 1.0, 2.5)
    before = [None if q.grad is None else q.grad.clone() for q in params]
    params[0].grad[0, 0] = math.inf
    before[0][0, 0] = math.inf
    with pytest.raises(RuntimeError, match="The total norm of order 2.0 for gradients from `parameters` is non-finite"):
        hp_fsdp.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for q, b in zip(params, before):
        assert (q.grad is None and b is None) or torch.equal(q.grad, b)
    with pytest.raises(RuntimeError, match="foreach=True was passed, but can't use the foreach API on meta tensors"):
        meta = nn.Parameter(torch.zeros(2, device="meta"))
        meta.grad = torch.zeros(2, device="meta")
        hp_fsdp.clip_grad_norm_([meta], 1.0, foreach=True)
