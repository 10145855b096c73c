# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Differential suite: our redistribute against ``torch.distributed.tensor`` on 4 gloo ranks.

Seeded random cases on meshes (4,), (2, 2) and (2, 1, 2): global shapes of 1-3 dims with sizes
1-13 (uneven shards included), source and target placements among Shard(d), Replicate and
Partial(sum|avg|max|min).  Both libraries get the same local shards (``from_local`` with the
global ``shape``) and redistribute to the same target; per case we compare, bit for bit, the
local shards, ``full_tensor()`` and the input gradients of ``(full_tensor() * W).sum()``, and
the collectives each issued: on every case the planner's cost model must not price our plan on
the busiest rank above torch's, that is wire bytes (ring collectives: all_reduce sends 2(n-1)/n of
its buffer, the others (n-1)/n; padding of uneven shards counts) plus a fixed latency per
collective.  The counts of cases where ours moves more bytes or issues more collectives than torch
are printed; more collectives than torch without fewer bytes fails the test.  Where the bytes-only
model (``BYTES_ONLY``: fewest bytes whatever the number of calls) plans otherwise, the case runs a
second time under it: its value must match too (large tensors take those plans), and its counts
against torch are printed beside the latency model's.  Values are multiples of
1/8 so that every sum is exact and the comparison can be bitwise whatever order a plan reduces in.

Where torch is known to be wrong the reference is a float64 single-process computation instead:
gloo's MAX/MIN drop NaN, so ``Partial(max|min)`` cases with a NaN are compared against it.  Where
the two libraries differ by convention only -- a ``Partial("sum")`` made from a replicated value
holds the value on coordinate 0 and zeros elsewhere here, ``value / n`` everywhere in torch -- the
local shards are compared through their reduction.

``HP_DIFF_CASES`` sets the number of cases (default 500; 5000 for a long local run).
"""

from __future__ import annotations

import itertools
import math
import os
import random
from typing import Any

from hp_dtensor.redistribute.planner import BYTES_ONLY, GLOO_CPU_LATENCY_BYTES, plan_redistribute
from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)

MESHES = ((4,), (2, 2), (2, 1, 2))
OPS = ("sum", "avg", "max", "min")
BATCH = 150

_state: dict[str, Any] = {}


# ---------------------------------------------------------------- case generation (every rank alike)
def _case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    mesh = rng.choice(MESHES)
    ndim = rng.randint(1, 3)
    shape = tuple(rng.randint(1, 13) for _ in range(ndim))

    def placements() -> tuple[tuple[str, Any], ...]:
        op = rng.choice(OPS)
        out = []
        for _ in mesh:
            kind = rng.choice(("S", "S", "R", "P"))
            out.append(("S", rng.randrange(ndim)) if kind == "S" else ("R", None) if kind == "R" else ("P", op))
        return tuple(out)

    src = placements()
    if rng.random() < 0.15:
        dst = placements()  # free-form: torch refuses most targets with a new Partial (public API)
    else:  # a Partial target only where the source has it, which torch accepts
        dst = tuple(
            s if s[0] == "P" and rng.random() < 0.5 else (("S", rng.randrange(ndim)) if rng.random() < 0.6 else ("R", None))
            for s in src
        )
    has_nan_op = any(k == "P" and v in ("max", "min") for k, v in src)
    nan = has_nan_op and rng.random() < 0.25
    return {"mesh": mesh, "shape": shape, "src": src, "dst": dst, "nan": nan, "seed": seed}


def _pl(lib: Any, spec: tuple[tuple[str, Any], ...]) -> list[Any]:
    return [lib.Shard(v) if k == "S" else lib.Replicate() if k == "R" else lib.Partial(v) for k, v in spec]


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    full = -(-size // n)
    start = min(size, full * i)
    return max(0, min(size, full * (i + 1)) - start), start


def _local_box(shape: tuple[int, ...], mesh: tuple[int, ...], spec: Any, coord: tuple[int, ...]) -> list[tuple[int, int]]:
    box = [(0, s) for s in shape]  # (offset, length) per dim, torch.chunk-style nested sharding
    for k, (kind, v) in enumerate(spec):
        if kind == "S":
            off, size = box[v]
            length, start = _chunk(size, mesh[k], coord[k])
            box[v] = (off + start, length)
    return box


def _local_data(case: dict[str, Any], coord: tuple[int, ...]) -> Any:
    """Each rank's source shard: the same along Replicate mesh dims, independent along Partial
    ones; multiples of 1/8 in [-4, 4)."""
    import torch

    spec, mesh = case["src"], case["mesh"]
    key = tuple(0 if kind == "R" else c for (kind, _), c in zip(spec, coord))
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + sum(c * 10**i for i, c in enumerate(key)))
    box = _local_box(case["shape"], mesh, spec, coord)
    partial_dims = [k for k, (kind, _) in enumerate(spec) if kind == "P"]
    shape = tuple(length for _, length in box)
    if partial_dims:
        data = torch.randint(-32, 32, shape, generator=gen).float() / 8
    else:  # Shard/Replicate only: slices of one global tensor
        full = torch.randint(-32, 32, case["shape"], generator=torch.Generator().manual_seed(case["seed"])).float() / 8
        data = full[tuple(slice(o, o + n) for o, n in box)].clone()
    if case["nan"] and data.numel() and key[partial_dims[0]] == 1:
        data.view(-1)[int(torch.randint(0, data.numel(), (1,), generator=gen))] = float("nan")
    return data


def _reference(case: dict[str, Any]) -> Any:
    """The global value of the source in float64 on one process (NaN propagates in max/min)."""
    import torch

    mesh, spec, shape = case["mesh"], case["src"], case["shape"]
    partial_dims = [k for k, (kind, _) in enumerate(spec) if kind == "P"]
    terms = []
    for pc in itertools.product(*(range(mesh[k]) for k in partial_dims)):
        full = torch.zeros(shape, dtype=torch.float64)
        for coord in itertools.product(*(range(n) for n in mesh)):
            if any(coord[k] != c for k, c in zip(partial_dims, pc)):
                continue
            box = _local_box(shape, mesh, spec, coord)
            full[tuple(slice(o, o + n) for o, n in box)] = _local_data(case, coord).double()
        terms.append(full)
    if not partial_dims:
        return terms[0]
    stack = torch.stack(terms)
    op = spec[partial_dims[0]][1]
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.mean(0)
    return stack.amax(0) if op == "max" else stack.amin(0)


# ---------------------------------------------------------------- torch's collectives, counted
def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _group_size(group: Any) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return int(_resolve_process_group(group).size() if isinstance(group, str) else group.size())


def wire_bytes(log: list[tuple[str, int, int | None]]) -> float:
    """Bytes one rank sends, for ring collectives over ``n`` ranks: all_reduce 2(n-1)/n of its
    buffer, the others (n-1)/n of theirs (all_gather's buffer is its output)."""
    total = 0.0
    for kind, nbytes, n in log:
        if n is None or n <= 1:
            continue
        total += nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)
    return total


def _torch_counter() -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    funcol = torch.ops._c10d_functional

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}
            self.log: list[tuple[str, int, int | None]] = []

        @property
        def bytes(self) -> int:
            return sum(b for _, b, _ in self.log)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            packet = getattr(func, "overloadpacket", None)
            entry: tuple[str, int, int | None] | None = None
            if packet is funcol.all_gather_into_tensor:
                entry = ("all_gather", _nbytes(args[0]) * int(args[1]), int(args[1]))
            elif packet is funcol.all_reduce:
                entry = ("all_reduce", _nbytes(args[0]), _group_size(args[2]))
            elif packet is funcol.reduce_scatter_tensor:
                entry = ("reduce_scatter", _nbytes(args[0]), int(args[2]))
            elif packet is funcol.all_to_all_single:
                entry = ("all_to_all", _nbytes(args[0]), _group_size(args[3]))
            elif packet is funcol.broadcast:
                entry = ("broadcast", _nbytes(args[0]), _group_size(args[2]))
            elif "c10d" in str(func) and "wait_tensor" not in str(func) and "wrap_tensor" not in str(func):
                entry = (str(func), 0, None)
            if entry is not None:
                self.counts[entry[0]] = self.counts.get(entry[0], 0) + 1
                self.log.append(entry)
            return func(*args, **kwargs)

    return Counter()


# ---------------------------------------------------------------- one batch, on every rank
def _meshes() -> dict[tuple[int, ...], Any]:
    if "meshes" not in _state:
        import logging

        # torch warns on every multi-dim plan it could flatten; the counts here say it once
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        from hp_dtensor import init_device_mesh

        _state["meshes"] = {m: (init_device_mesh("cpu", m), torch_mesh("cpu", m)) for m in MESHES}
    return _state["meshes"]  # type: ignore[no-any-return]


def _run_lib(lib: Any, dt_cls: Any, mesh: Any, case: dict[str, Any], local: Any, weight: Any, counter: Any) -> Any:
    x = local.clone().requires_grad_(True)
    d = dt_cls.from_local(x, mesh, _pl(lib, case["src"]), shape=case["shape"], stride=_strides(case["shape"]))
    with counter:
        out = d.redistribute(mesh, _pl(lib, case["dst"]))
    full = out.full_tensor()
    (full * weight).nansum().backward()
    return out.to_local().detach(), full.detach(), x.grad


def _bytes_only_run(hp: Any, dt_cls: Any, mesh: Any, case: dict[str, Any], local: Any) -> Any:
    """``(local, full, CommDebugMode)`` of our redistribute planned by bytes alone, or ``None``
    where that plan is the latency model's own (every rank decides alike: the plans are pure)."""
    from hp_dtensor import CommDebugMode
    from hp_dtensor.redistribute.planner import cost_model, set_cost_model

    src, dst = tuple(_pl(hp, case["src"])), tuple(_pl(hp, case["dst"]))
    args = (case["mesh"], case["shape"], src, dst, int(local.element_size()))
    if plan_redistribute(*args, model=BYTES_ONLY).steps == plan_redistribute(*args).steps:
        return None
    comm = CommDebugMode()
    before = cost_model()
    set_cost_model(BYTES_ONLY)
    try:
        d = dt_cls.from_local(local.clone(), mesh, list(src), shape=case["shape"], stride=_strides(case["shape"]))
        with comm:
            out = d.redistribute(mesh, list(dst))
        return out.to_local(), out.full_tensor(), comm
    finally:
        set_cost_model(before)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _same(a: Any, b: Any) -> bool:
    import torch

    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(torch.nan_to_num(a, nan=1e30), torch.nan_to_num(b, nan=1e30))) and bool(torch.equal(a.isnan(), b.isnan()))


def _diff_batch(rank: int, world: int, seeds: list[int]) -> dict[str, Any]:
    import torch
    import torch.distributed.tensor as tdt

    import hp_dtensor as hp
    from hp_dtensor import CommDebugMode
    from hp_dtensor.platform.torch import DTensor

    meshes = _meshes()
    stats: dict[str, Any] = {
        "cases": 0, "mismatches": [], "ours_bytes": 0, "torch_bytes": 0, "more_bytes": [],
        "torch_nan_gap": 0, "nan_cases": 0, "partial_convention": 0, "torch_refused": 0, "ours_refused": 0,
        "uneven": 0, "count_diff": 0, "refusals": [], "bytes": [], "bytes_only": [],
    }
    for seed in seeds:
        case = _case(seed)
        ours_mesh, torch_mesh = meshes[case["mesh"]]
        coord = ours_mesh.get_coordinate()
        local = _local_data(case, coord)
        ref = _reference(case)
        weight = (torch.arange(ref.numel(), dtype=torch.float32).reshape(ref.shape) % 7 - 3) / 4
        stats["cases"] += 1
        stats["nan_cases"] += int(case["nan"])
        if any(s % math.prod(case["mesh"]) for s in case["shape"]):
            stats["uneven"] += 1
        ours_comm = CommDebugMode()
        try:
            o_local, o_full, o_grad = _run_lib(hp, DTensor, ours_mesh, case, local, weight, ours_comm)
        except ValueError as e:
            o_local = e
        t_comm = _torch_counter()
        try:
            t_local, t_full, t_grad = _run_lib(tdt, tdt.DTensor, torch_mesh, case, local, weight, t_comm)
        except Exception as e:  # torch refuses (e.g. Partial -> another Partial op)
            t_local = e
        where = f"seed {seed} {case['mesh']} {case['shape']} {case['src']} -> {case['dst']}"
        if isinstance(o_local, Exception):
            stats["ours_refused"] += 1
            if not isinstance(t_local, Exception):
                stats["mismatches"].append(f"{where}: ours raised {o_local!r}, torch ran")
            continue
        # the value: bit for bit against the float64 reference, always
        if not _same(o_full, ref.float()):
            stats["mismatches"].append(f"{where}: full_tensor differs from the float64 reference")
            continue
        alt = _bytes_only_run(hp, DTensor, ours_mesh, case, local)
        if alt is not None:
            if not (_same(alt[1], ref.float()) and _same(alt[0], o_local)):
                stats["mismatches"].append(f"{where}: the bytes-only plan's result differs")
                continue
            alt_comm = alt[2]
        else:
            alt_comm = ours_comm
        if isinstance(t_local, Exception):
            stats["torch_refused"] += 1
            reason = str(t_local).split("\n")[0][:90]
            stats.setdefault("refusals", []).append(reason)
            continue
        torch_wrong = not _same(t_full, ref.float())
        if torch_wrong:
            if case["nan"]:
                stats["torch_nan_gap"] += 1  # gloo MAX/MIN dropped the NaN: the reference decides
                continue
            stats["mismatches"].append(f"{where}: torch's full_tensor differs from the reference")
            continue
        if not _same(o_local, t_local):
            dst_partial_sum = any(k == "P" and v == "sum" for k, v in case["dst"])
            if dst_partial_sum:
                stats["partial_convention"] += 1
            else:
                stats["mismatches"].append(f"{where}: local shards differ")
                continue
        if not _same(o_grad, t_grad):
            stats["mismatches"].append(f"{where}: input gradients differ {o_grad} vs {t_grad}")
            continue
        ob = sum(ours_comm.get_comm_bytes().values())
        stats["ours_bytes"] += ob
        stats["torch_bytes"] += t_comm.bytes
        stats["bytes"].append((seed, ob, t_comm.bytes, wire_bytes(ours_comm.comm_log), wire_bytes(t_comm.log), where,
                               ours_comm.get_comm_counts(), t_comm.counts))
        stats["bytes_only"].append((seed, wire_bytes(alt_comm.comm_log), sum(alt_comm.get_comm_counts().values()),
                                    alt is not None))
        if ours_comm.get_comm_counts() != t_comm.counts:
            stats["count_diff"] += 1
    return stats


def test_redistribute_matches_torch(pool4: RankPool, capsys: Any) -> None:
    n = int(os.environ.get("HP_DIFF_CASES", "500"))
    seeds = list(range(n))
    total: dict[str, Any] = {}
    for i in range(0, n, BATCH):
        per_rank = pool4.run(_diff_batch, seeds[i : i + BATCH])
        for key in per_rank[0]:
            for r in per_rank:
                v = r[key]
                if isinstance(v, list):
                    total.setdefault(key, []).extend(v)
                else:
                    total[key] = total.get(key, 0) + v
    cases = total["cases"] // 4
    # per case, on the busiest rank: the planner's model (wire bytes plus a latency per
    # collective) must never price our plan above torch's; more bytes than torch is allowed only
    # where it buys fewer collectives, and more collectives only where they save enough bytes
    by_seed: dict[int, list[Any]] = {}
    for row in total["bytes"]:
        by_seed.setdefault(row[0], []).append(row)
    bytes_only: dict[int, list[Any]] = {}
    for row in total["bytes_only"]:
        bytes_only.setdefault(row[0], []).append(row)
    more, more_bytes, more_calls, not_cheaper = [], 0, 0, []
    ours_wire = torch_wire = 0.0
    ours_calls = torch_calls = 0
    b_calls = b_more_calls = b_not_cheaper = replanned = 0
    for seed, rows in by_seed.items():
        o, t = max(r[3] for r in rows), max(r[4] for r in rows)
        oc, tc = max(sum(r[6].values()) for r in rows), max(sum(r[7].values()) for r in rows)
        ours_wire, torch_wire, ours_calls, torch_calls = ours_wire + o, torch_wire + t, ours_calls + oc, torch_calls + tc
        more_bytes += o > t + 1e-9
        more_calls += oc > tc
        if oc > tc and o >= t - 1e-9:  # more calls must buy fewer bytes
            not_cheaper.append(f"{rows[0][5]}: ours {rows[0][6]} {o:.0f} B, torch {rows[0][7]} {t:.0f} B")
        if o + oc * GLOO_CPU_LATENCY_BYTES > t + tc * GLOO_CPU_LATENCY_BYTES + 1e-9:
            more.append(f"{rows[0][5]}: ours {rows[0][6]} {o:.0f} B > torch {rows[0][7]} {t:.0f} B under the model")
        alt = bytes_only[seed]
        bo, bc = max(r[1] for r in alt), max(r[2] for r in alt)
        replanned += alt[0][3]
        b_calls += bc
        b_more_calls += bc > tc
        b_not_cheaper += bc > tc and bo >= t - 1e-9
    reasons: dict[str, int] = {}
    for r in total["refusals"]:
        reasons[r] = reasons.get(r, 0) + 1
    with capsys.disabled():  # the size of the proof shows in every run, captured or not
        print(
            f"\nredistribute vs torch.distributed.tensor: {cases} cases x 4 ranks ({total['uneven'] // 4} with a "
            f"dim the mesh does not divide), {len(total['mismatches'])} mismatching rank-cases; compared with torch "
            f"(values, local shards, gradients, bytes): {len(by_seed)} cases; wire bytes on the busiest rank, summed "
            f"over cases: ours {ours_wire:.0f} vs torch {torch_wire:.0f} ({more_bytes} cases where ours is more); "
            f"collectives on the busiest rank: ours {ours_calls} vs torch {torch_calls} ({more_calls} cases where ours "
            f"issues more, {len(not_cheaper)} of them without fewer bytes); cases our plan costs more than torch's "
            f"under the latency model: {len(more)}; planned by bytes alone ({replanned} cases plan otherwise, rerun "
            f"and matched): collectives {b_calls}, {b_more_calls} cases with more than torch, {b_not_cheaper} of "
            f"them without fewer bytes; "
            f"collective buffers summed over ranks: ours {total['ours_bytes']} vs torch {total['torch_bytes']}; "
            f"{total['count_diff']} rank-cases with other collective counts; torch refused {total['torch_refused'] // 4} "
            f"(reference only), we refused {total['ours_refused'] // 4}; NaN cases {total['nan_cases'] // 4} (torch "
            f"dropped the NaN in {total['torch_nan_gap'] // 4}: compared with the float64 reference); local shards "
            f"differing by the Partial(sum) convention only: {total['partial_convention']} rank-cases"
        )
        for r, c in sorted(reasons.items(), key=lambda x: -x[1]):
            print(f"   torch refused ({c // 4}x): {r}")
        for line in total["mismatches"][:20] + more[:20] + not_cheaper[:20]:
            print("  ", line)
    assert cases >= min(n, 500)
    assert not total["mismatches"]
    assert not not_cheaper
    assert not more
