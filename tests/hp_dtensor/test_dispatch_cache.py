# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The dispatch decision cache never gives one call another call's answer: every element the
decision depends on is in the key (specs, dtypes, argument types, structure, keyword arguments).

The first tests check the neutral key directly; the last ones run ops on one process over the
fake process group (decisions and output specs need no data) in an order that would reuse a
stale decision if a key element were dropped, and compare with the answer a cold cache gives."""

from __future__ import annotations

from typing import Any

import pytest

from hp_dtensor.sharding.dispatch import call_key
from hp_dtensor.testing import fake_world


class _Spec:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.mesh = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Spec) and other.shape == self.shape

    def __hash__(self) -> int:
        return hash(self.shape)


class _DT:
    """A stand-in DTensor: what the key reads is ``_spec`` and ``dtype``."""

    def __init__(self, shape: tuple[int, ...], dtype: str = "f32") -> None:
        self._spec = _Spec(shape)
        self.dtype = dtype


class _Plain:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _key(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, value_free_floats: bool = False) -> Any:
    return call_key("op", args, kwargs or {}, _DT, _Plain, lambda t: t.shape, value_free_floats)


def test_key_tells_apart_what_decisions_depend_on() -> None:
    x = _DT((4, 6))
    distinct = [
        _key((x, 1)),
        _key((x, True)),  # keepdim=True is not dim=1
        _key((x, 1.0)),
        _key((x, [0, 1])),
        _key((x, (0, 1))),
        _key((x, 0, 1)),  # sum(x, [0, 1]) flattens to the leaves of sum(x, 0, 1)
        _key((x, [[0], [1]])),
        _key((_DT((5, 6)), 1)),  # another global shape (uneven where (4, 6) is even)
        _key((_DT((4, 6), "f16"), 1)),  # another dtype
        _key((x,), {"dim": 1}),  # keyword, not positional
        _key((x,), {"dim": 0}),
        _key((x,), {"keepdim": 1}),
        _key((x, _Plain((6,)))),
        _key((x, _Plain((1, 6)))),
        _key((x, None)),
        _key((x, "1")),
    ]
    assert None not in distinct
    assert len(set(distinct)) == len(distinct), "two different calls share a cache key"
    assert _key((_DT((4, 6)), [0, 1])) == _key((x, [0, 1]))  # equal specs: one decision


def test_float_values_share_a_key_only_where_asked() -> None:
    x = _DT((4,))
    assert _key((x, 0.5)) != _key((x, 0.25))
    assert _key((x, 0.5), value_free_floats=True) == _key((x, 0.25), value_free_floats=True)
    assert _key((x, 1), value_free_floats=True) != _key((x, 1.0), value_free_floats=True)


def test_dict_argument_is_not_cached() -> None:
    assert _key((_DT((4,)), {"a": 1})) is None


def _specs(out: Any) -> Any:
    from hp_dtensor.platform.torch import DTensor

    if isinstance(out, DTensor):
        return (tuple(out.shape), out.dtype, tuple(out.placements), tuple(out.to_local().shape))
    if isinstance(out, (list, tuple)):
        return [_specs(o) for o in out]
    return out


def _calls() -> list[tuple[str, Any]]:
    """Pairs of calls to one op that differ in one key element only."""
    import torch

    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    even = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)])
    uneven = distribute_tensor(torch.zeros(5, 6), mesh, [Shard(0)])
    f32 = distribute_tensor(torch.zeros(4, 8), mesh, [Replicate()])
    f16 = distribute_tensor(torch.zeros(4, 8, dtype=torch.float16), mesh, [Replicate()])
    return [
        ("shape even", lambda: even + 1),
        ("shape uneven", lambda: uneven + 1),
        ("dtype f32", lambda: f32.view(torch.int8)),
        ("dtype f16", lambda: f16.view(torch.int8)),
        ("kwarg dim 0", lambda: torch.sum(even, dim=0)),
        ("kwarg dim 1", lambda: torch.sum(even, dim=1)),
        ("keepdim", lambda: torch.sum(even, dim=1, keepdim=True)),
        ("view list", lambda: even.view(2, 12)),
        ("view other", lambda: even.view(4, 3, 2)),
        ("scalar int", lambda: even * 2),
        ("scalar float", lambda: even * 2.5),
        ("split", lambda: even.split(2, dim=1)),
        ("split other", lambda: even.split(3, dim=1)),
    ]


def test_torch_cache_gives_each_call_its_own_answer() -> None:
    pytest.importorskip("torch")
    from hp_dtensor.platform.torch import dispatch

    with fake_world(2, rank=1):
        cold = {}
        for name, fn in _calls():
            dispatch._CORE.cache.clear()
            cold[name] = _specs(fn())
        warm_runs = [_specs(fn()) for _ in range(2) for _, fn in _calls()]
        names = [name for _ in range(2) for name, _ in _calls()]
    for a, b in [("shape even", "shape uneven"), ("dtype f32", "dtype f16"), ("kwarg dim 0", "kwarg dim 1"),
                 ("kwarg dim 1", "keepdim"), ("view list", "view other"), ("split", "split other")]:
        assert cold[a] != cold[b], f"{a} and {b} should differ (the test would not catch a dropped key element)"
    for name, got in zip(names, warm_runs):
        assert got == cold[name], f"{name}: the warm cache gave {got}, a cold one {cold[name]}"


def test_equal_meshes_from_different_roots_keep_their_own_mesh() -> None:
    """mesh_a['tp'] and mesh_b['tp'] compare equal (same ranks, same name) but come from different
    roots; an op's output must carry its own input's mesh object, not the one a cached decision
    saw first (fully_shard reads a TP parameter's root mesh to combine it with the dp dims)."""
    pytest.importorskip("torch")
    import torch

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    with fake_world(4, rank=0):
        root_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        root_b = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        tp_a, tp_b = root_a["tp"], root_b["tp"]
        assert tp_a == tp_b and tp_a.get_root_mesh() is not tp_b.get_root_mesh()
        for op in (lambda t: t + 1, lambda t: t.view(4, 3), lambda t: t.detach()):
            x = distribute_tensor(torch.zeros(4, 3), tp_a, [Shard(0)])
            y = distribute_tensor(torch.zeros(4, 3), tp_b, [Shard(0)])
            for _ in range(2):  # the second round runs from the warm cache
                assert op(x).device_mesh.get_root_mesh() is root_a
                assert op(y).device_mesh.get_root_mesh() is root_b


def test_in_place_steady_state_writes_the_local_tensor_and_returns_self() -> None:
    """An in-place op whose written argument keeps its layout and whose inputs stay where they are
    (a gradient accumulated into a parameter's) runs from the warm cache as the bare local call;
    one that must move an input, or needs a kernel (a scalar added once to a partial sum), keeps
    the full path.  Each gives, warm and cold, the local values plain tensors give."""
    pytest.importorskip("torch")
    import torch

    from hp_dtensor import Partial, Replicate, Shard, init_device_mesh
    from hp_dtensor.platform.torch import dispatch

    def run(rank: int, warm: bool) -> dict[str, Any]:
        # (no data moves in a fake world: every DTensor is made from its local values)
        g = torch.Generator().manual_seed(rank)
        a, b = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
        mesh = init_device_mesh("cpu", (2,))
        cases = {
            "shard += shard": (lambda: _from_local(a.chunk(2)[rank], mesh, Shard(0)),
                               lambda: _from_local(b.chunk(2)[rank], mesh, Shard(0)),
                               lambda x, y: x.add_(y, alpha=2.0), a.chunk(2)[rank] + 2.0 * b.chunk(2)[rank]),
            "partial += partial": (lambda: _from_local(a, mesh, Partial()), lambda: _from_local(b, mesh, Partial()),
                                   lambda x, y: x.add_(y), a + b),
            "replicate *= 3": (lambda: _from_local(a, mesh, Replicate()), lambda: None,
                               lambda x, y: x.mul_(3), a * 3),
            "shard += replicate (moves)": (lambda: _from_local(a.chunk(2)[rank], mesh, Shard(0)),
                                           lambda: _from_local(b, mesh, Replicate()),
                                           lambda x, y: x.add_(y), a.chunk(2)[rank] + b.chunk(2)[rank]),
            "partial += 1 (kernel)": (lambda: _from_local(a, mesh, Partial()), lambda: None,
                                      lambda x, y: x.add_(1.0), a + (1.0 if rank == 0 else 0.0)),
        }
        out = {}
        for name, (make_x, make_y, op, want) in cases.items():
            x, y = make_x(), make_y()
            if warm:
                op(make_x(), make_y())  # fills the cache
            else:
                dispatch._CORE.cache.clear()
            r = op(x, y)
            out[name] = (r is x, torch.equal(x.to_local(), want), tuple(x.placements))
        return out

    for rank in (0, 1):
        with fake_world(2, rank=rank):
            cold, warm = run(rank, False), run(rank, True)
            directs = {k[0] for k, v in dispatch._CORE.cache.items() if v is not None and v.direct_inplace}
        assert cold == warm, (cold, warm)
        assert all(same and equal for same, equal, _ in warm.values()), warm
    aten = torch.ops.aten
    assert id(aten.add_.Tensor) in directs, "shard += shard did not take the in-place steady state"
    assert directs & {id(aten.mul_.Tensor), id(aten.mul_.Scalar)}, "replicate *= 3 did not take it"


def _from_local(t: Any, mesh: Any, placement: Any) -> Any:
    from hp_dtensor.platform.torch import DTensor

    return DTensor.from_local(t.clone(), mesh, [placement], run_check=False)
