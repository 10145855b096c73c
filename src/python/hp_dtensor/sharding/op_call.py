"""The two values every sharding rule works on: what came in, what to do."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hp_dtensor.placement_types import Placement, Replicate, Shard
from hp_dtensor.redistribute.planner import step_cost as _step_cost
from hp_dtensor.redistribute.planner import step_kind as _step_kind


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A DTensor argument as rules see it: global shape and placements (one per mesh dim)."""

    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    # The dtype as the framework prints it (``torch.float16``, ``Float16``), for the rules whose
    # answer depends on it (casts); None where the caller does not say.  Not part of equality:
    # decisions are cached per dtype already.
    dtype: str | None = field(default=None, compare=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class OpCall:
    """One op call: ``args``/``kwargs`` with ``TensorInfo`` in place of each DTensor."""

    name: str
    mesh_shape: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    # This rank's mesh coordinate: rules that rewrite sizes for the local call need it when a
    # shard is uneven (its local size depends on the rank).  None: the layout must be even.
    coordinate: tuple[int, ...] | None = None

    def tensors(self) -> list[TensorInfo]:
        """The DTensor arguments in flat order (args then kwargs, lists flattened)."""
        out: list[TensorInfo] = []

        def visit(x: Any) -> None:
            if isinstance(x, TensorInfo):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    visit(y)

        for a in self.args:
            visit(a)
        for v in self.kwargs.values():
            visit(v)
        return out


@dataclass(frozen=True)
class Decision:
    """What to do with one op call.

    ``inputs``: target placements per DTensor input (flat order), ``None`` to leave it alone.
    ``outputs``: placements per tensor output (flat order), ``None`` for a non-DTensor output.
    ``args``/``kwargs``: rewritten arguments for the local call, ``None`` to keep the originals.
    ``kernel``: name of a platform kernel to run instead of the op (e.g. masked embedding).
    ``out_shape``: global shape of the tensor outputs, set by rules that keep uneven shards.
    """

    inputs: tuple[tuple[Placement, ...] | None, ...]
    outputs: tuple[tuple[Placement, ...] | None, ...]
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    kernel: str | None = None
    out_shape: tuple[int, ...] | None = None  # global shape of the tensor outputs when a local shape
    # cannot tell it (uneven shards); None: inferred from the local output under even sharding


Rule = Callable[[OpCall], Decision]

_R = Replicate()


def transition_cost(src: Placement, dst: Placement, mesh_size: int, numel: int) -> float:
    """Cost of changing one mesh dim's placement, in elements moved (planner's cost model)."""
    if src == dst:
        return 0.0
    if isinstance(src, Shard):
        numel //= mesh_size  # the planner's costs are in local elements
    kind = _step_kind(src, dst)
    if kind is None:  # two steps through Replicate
        return _step_cost(_step_kind(src, _R) or "", mesh_size, numel)
    return _step_cost(kind, mesh_size, numel)


def per_mesh_dim(
    call: OpCall,
    choose: Callable[[int, list[Placement]], tuple[list[Placement], list[Placement]]],
    n_outputs: int,
) -> Decision:
    """Build a Decision from a rule that decides one mesh dim at a time.

    ``choose(mesh_dim, input_placements)`` returns (required input placements, output placements)
    for that mesh dim.
    """
    infos = call.tensors()
    ins: list[list[Placement]] = [[] for _ in infos]
    outs: list[list[Placement]] = [[] for _ in range(n_outputs)]
    for k in range(len(call.mesh_shape)):
        req, out = choose(k, [t.placements[k] for t in infos])
        for i, p in enumerate(req):
            ins[i].append(p)
        for i, p in enumerate(out):
            outs[i].append(p)
    return Decision(tuple(tuple(p) for p in ins), tuple(tuple(p) for p in outs))


def cheapest(
    candidates: Sequence[tuple[list[Placement], list[Placement]]],
    current: Sequence[Placement],
    infos: Sequence[TensorInfo],
    mesh_size: int,
) -> tuple[list[Placement], list[Placement]]:
    """The candidate (inputs, outputs) whose input redistribution costs least; first wins ties.
    Candidates that would shard a dim the mesh dim does not divide are skipped."""
    best = None
    best_cost = float("inf")
    numels = [t.numel for t in infos]
    for req, out in candidates:
        if any(
            isinstance(r, Shard) and (r.dim >= t.ndim or t.shape[r.dim] % mesh_size != 0)
            for r, t in zip(req, infos)
        ):
            continue
        cost = sum(transition_cost(c, r, mesh_size, n) for c, r, n in zip(current, req, numels))
        # Free changes (a local chunk) still cost a little: among equals keep inputs as they are,
        # so replicated inputs give a replicated output instead of an arbitrary shard.
        cost += 1e-3 * sum(c != r for c, r in zip(current, req))
        if cost < best_cost:
            best, best_cost = (req, out), cost
    assert best is not None
    return best


def keeps_uneven(rule: Rule, n_outputs: int = 1, kernel_name: str | None = None) -> Rule:
    """Mark a pointwise ``rule``: on unevenly sharded inputs dispatch may run it shard by shard
    (``uneven_pointwise_rule``) with ``n_outputs`` outputs and ``kernel_name`` as its local kernel."""
    rule.uneven_pointwise = n_outputs  # type: ignore[attr-defined]
    rule.uneven_kernel = kernel_name  # type: ignore[attr-defined]
    return rule


def sees_uneven(rule: Rule, uneven_rule: Callable[[OpCall], Decision | None]) -> Rule:
    """Give ``rule`` an ``uneven_rule``: on unevenly sharded inputs dispatch asks it first, with
    the real layout; its decision (which must set ``out_shape`` when it keeps the uneven layout)
    is taken, and None falls back to ``rule`` on the nearest even layout."""
    rule.uneven_rule = uneven_rule  # type: ignore[attr-defined]
    return rule


def replicated_rule(call: OpCall) -> Decision:
    """Compute on whole tensors: for the shapes of an op that its rule has no sharding for."""
    rep = tuple(Replicate() for _ in call.mesh_shape)
    return Decision(tuple(rep for _ in call.tensors()), (rep,))


class OpRules(dict[str, Rule]):
    """Which rule each op of one framework uses, keyed by the op's name as that framework's
    dispatch reports it (``aten.mm.default`` on torch, ``MatMul`` on MindSpore).

    Each rule module lists the ops it covers in one of these; a name listed twice is an error at
    import, not a silent override.  ``namespace`` and ``default_overload`` spell aten's names
    briefly: ``add.Tensor`` is ``aten.add.Tensor``, ``mm`` is ``aten.mm.default``."""

    def __init__(self, namespace: str = "", default_overload: str = "") -> None:
        super().__init__()
        self._prefix = f"{namespace}." if namespace else ""
        self._default = default_overload

    def _full_name(self, name: str) -> str:
        if self._default and "." not in name:
            name = f"{name}.{self._default}"
        return self._prefix + name

    def add(self, names: str, rule: Rule) -> Rule:
        """Use ``rule`` for every whitespace-separated op in ``names``; returns ``rule``."""
        for name in names.split():
            self._claim(self._full_name(name), rule)
        return rule

    def _claim(self, name: str, rule: Rule) -> None:
        if name in self:
            raise ValueError(f"op {name} is given two sharding rules; list it once")
        self[name] = rule

    def merge(self, *tables: OpRules) -> OpRules:
        """This table with every entry of ``tables`` added (the same duplicate check)."""
        for table in tables:
            for name, rule in table.items():
                self._claim(name, rule)
        return self


class Kernels(dict[str, Callable[..., Any]]):
    """One platform's local kernels, by the name a ``Decision.kernel`` gives: the framework code
    some rules need beyond running the op on the shards."""

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self[name] = fn
            return fn

        return deco


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` (tuples, lists, dicts) with ``fn`` applied to every leaf: how a Decision's rewritten
    arguments get their TensorInfo placeholders replaced by local tensors."""
    if isinstance(tree, tuple):
        return tuple(map_leaves(fn, x) for x in tree)
    if isinstance(tree, list):
        return [map_leaves(fn, x) for x in tree]
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    return fn(tree)
