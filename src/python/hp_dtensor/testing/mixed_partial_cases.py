"""Partial("sum") mixed with Partial("avg"), checked on any backend against float64 arithmetic.

The two reductions commute (an average of sums is a sum of averages, scaled), so
``torch.distributed.tensor`` accepts them together, on one tensor's mesh dims and between an op's
operands, and computes the reduced value; every other mix of reduce ops is refused.  These cases
pin both halves on 4 ranks (a 2x2 mesh and a 4-rank 1-D mesh), so a backend that refuses the mix
or, worse, reduces it wrongly fails.  Pure Python on the reference side: a backend supplies only
how to make a float64 tensor from nested lists and how to read one back.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

Matrix = list[list[float]]
TOLERANCE = 1e-12  # float64 on both sides; only the order of the sums differs


def _draw(rng: random.Random, rows: int, cols: int) -> Matrix:
    return [[rng.uniform(-2.0, 2.0) for _ in range(cols)] for _ in range(rows)]


def _sum(ms: Sequence[Matrix]) -> Matrix:
    return [[sum(m[i][j] for m in ms) for j in range(len(ms[0][0]))] for i in range(len(ms[0]))]


def _map2(f: Callable[[float, float], float], a: Matrix, b: Matrix) -> Matrix:
    return [[f(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def _scale(a: Matrix, c: float) -> Matrix:
    return [[x * c for x in r] for r in a]


def _matmul(a: Matrix, b: Matrix) -> Matrix:
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def _flat(v: Any) -> list[float]:
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flat(item)]
    return [float(v)]


def mixed_partial_case(
    rank: int, world: int, tensor: Callable[[Matrix], Any], to_list: Callable[[Any], Any]
) -> dict[str, object]:
    """Run on every rank of a 4-rank job: case name -> largest error against the float64
    reference, or ``"raised <type>: <message>"``.  ``tensor`` makes a float64 tensor of the
    backend from nested lists, ``to_list`` reads a plain tensor back as nested lists (or a float)."""
    from hp_dtensor import DTensor, Partial, Replicate, distribute_tensor, init_device_mesh

    if world != 4:
        raise ValueError(f"the mixed Partial cases run on 4 ranks, got {world}")
    rng = random.Random(20261201)
    xs = [_draw(rng, 4, 6) for _ in range(world)]  # per-rank terms; the sum is the value
    ys = [_draw(rng, 4, 6) for _ in range(world)]
    zs = [_draw(rng, 6, 3) for _ in range(world)]
    w = _draw(rng, 6, 3)
    S, T, U = _sum(xs), _sum(ys), _sum(zs)
    sum_, avg = Partial("sum"), Partial("avg")
    out: dict[str, object] = {}

    def case(name: str, run: Callable[[], Any], want: Any) -> None:
        try:
            got = _flat(to_list(run()))
            ref = _flat(want)
            if len(got) != len(ref):
                out[name] = f"wrong size {len(got)}, expected {len(ref)}"
            else:
                out[name] = max(abs(g - r) for g, r in zip(got, ref))
        except Exception as e:  # noqa: BLE001  (the report names it; the check decides)
            out[name] = f"raised {type(e).__name__}: {e}"

    mesh = init_device_mesh("cpu", (2, 2))
    rep = [Replicate(), Replicate()]

    def two(terms: list[Matrix], pl: list[Any]) -> Any:
        return DTensor.from_local(tensor(terms[rank]), mesh, pl)

    # On a 2x2 mesh, [Partial(sum), Partial(avg)] holds the sum over mesh dim 0 averaged over dim 1:
    # the sum of all four terms halved, in either order.
    half_s, half_t = _scale(S, 0.5), _scale(T, 0.5)
    case("2x2 from_local [sum, avg]", lambda: two(xs, [sum_, avg]).full_tensor(), half_s)
    case("2x2 from_local [avg, sum]", lambda: two(xs, [avg, sum_]).full_tensor(), half_s)
    case("2x2 distribute [sum, avg]", lambda: distribute_tensor(tensor(xs[0]), mesh, [sum_, avg]).full_tensor(), xs[0])
    case("2x2 [sum, avg] + [sum, avg]", lambda: (two(xs, [sum_, avg]) + two(ys, [sum_, avg])).full_tensor(),
         _map2(lambda a, b: a + b, half_s, half_t))
    case("2x2 [sum, avg] + [sum, sum]", lambda: (two(xs, [sum_, avg]) + two(ys, [sum_, sum_])).full_tensor(),
         _map2(lambda a, b: a + b, half_s, T))
    case("2x2 [sum, avg] * 3", lambda: (two(xs, [sum_, avg]) * 3.0).full_tensor(), _scale(half_s, 3.0))
    case("2x2 [sum, avg] * [sum, avg]", lambda: (two(xs, [sum_, avg]) * two(ys, [sum_, avg])).full_tensor(),
         _map2(lambda a, b: a * b, half_s, half_t))
    case("2x2 [sum, avg].sum()", lambda: two(xs, [sum_, avg]).sum().full_tensor(), sum(_flat(half_s)))
    case("2x2 [sum, avg] @ replicated", lambda: (two(xs, [sum_, avg]) @ DTensor.from_local(tensor(w), mesh, rep))
         .full_tensor(), _matmul(half_s, w))
    case("2x2 [sum, avg] -> [replicate, avg]",
         lambda: two(xs, [sum_, avg]).redistribute(mesh, [Replicate(), avg]).full_tensor(), half_s)
    case("2x2 [sum, avg] -> [sum, replicate]",
         lambda: two(xs, [sum_, avg]).redistribute(mesh, [sum_, Replicate()]).full_tensor(), half_s)
    case("2x2 from_local [sum, max] (refused)", lambda: two(xs, [sum_, Partial("max")]), None)

    line = init_device_mesh("cpu", (4,))

    def one(terms: list[Matrix], p: Any) -> Any:
        return DTensor.from_local(tensor(terms[rank]), line, [p])

    quarter_t = _scale(T, 0.25)
    case("4 sum + avg", lambda: (one(xs, sum_) + one(ys, avg)).full_tensor(), _map2(lambda a, b: a + b, S, quarter_t))
    case("4 avg - sum", lambda: (one(ys, avg) - one(xs, sum_)).full_tensor(), _map2(lambda a, b: b - a, S, quarter_t))
    case("4 sum * avg", lambda: (one(xs, sum_) * one(ys, avg)).full_tensor(), _map2(lambda a, b: a * b, S, quarter_t))
    case("4 sum @ avg", lambda: (one(xs, sum_) @ one(zs, avg)).full_tensor(), _matmul(S, _scale(U, 0.25)))
    return out


def check_mixed_partials(results: Sequence[dict[str, object]]) -> int:
    """Assert every rank's ``mixed_partial_case`` report: each sum/avg case within ``TOLERANCE`` of
    the reference, the sum/max mix refused naming the reduce ops.  Returns the cases checked."""
    checked = 0
    for rank, report in enumerate(results):
        for name, got in report.items():
            if name.endswith("(refused)"):
                assert isinstance(got, str) and got.startswith("raised ValueError") and "mix Partial" in got, (
                    rank, name, got)
            else:
                assert isinstance(got, float) and got <= TOLERANCE, (rank, name, got)
            checked += 1
    return checked
