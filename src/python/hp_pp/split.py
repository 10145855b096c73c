"""Which decoder layers each pipeline stage holds: the ``pipeline_parallel_layers_per_stage`` rule.

``pp`` physical stages (ranks along the ``pp`` mesh dim), each cut into ``interleave`` model chunks,
give ``pp * interleave`` virtual stages.  Segment ``k`` of physical stage ``i`` is virtual stage
``k * pp + i``, so virtual stage ``v`` runs on pp rank ``v % pp``.  ``"auto"`` places the layers
contiguously, the same number per virtual stage; the explicit form is one string per physical
stage holding ``interleave`` comma-separated closed ranges (``"0-1, 4-8"``, a single layer ``"9"``).
Read in virtual-stage order the ranges must list ``0 .. num_layers-1`` exactly once, increasing.
The embedding lives on virtual stage 0; the final norm, the output head and the loss on the last.
Pure: no framework.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from hp_pp.errors import PipelineConfigError

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class StageSplit:
    """The layers of every virtual stage (``layers[v]``), for ``pp`` ranks of ``interleave`` chunks."""

    pp: int
    interleave: int
    num_layers: int
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_virtual(self) -> int:
        return self.pp * self.interleave

    def rank_of(self, virtual_stage: int) -> int:
        """The pp rank that runs ``virtual_stage``."""
        return stage_rank(virtual_stage, self.pp)

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The virtual stages pp rank ``pp_rank`` runs, in increasing order (chunk 0 first)."""
        return tuple(k * self.pp + pp_rank for k in range(self.interleave))

    def describe(self) -> str:
        parts = []
        for v, ls in enumerate(self.layers):
            span = f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else (str(ls[0]) if ls else "none")
            parts.append(f"v{v}@pp{self.rank_of(v)}: layers {span}")
        return "; ".join(parts)


def stage_rank(virtual_stage: int, pp: int) -> int:
    return virtual_stage % pp


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def split_layers(
    spec: str | Sequence[str] | None, num_layers: int, pp: int, interleave: int = 1
) -> StageSplit:
    """The ``StageSplit`` of ``spec`` (``"auto"`` or one range string per physical stage).

    Raises ``PipelineConfigError`` (a ``ValueError``) naming the offending value and what to write
    instead: a missing spec, ``auto`` on a layer count that ``pp * interleave`` does not divide, a
    list of the wrong length, a stage with the wrong number of segments, a malformed, reversed,
    empty, overlapping, missing or out-of-order range."""
    pp = _positive("pipeline_parallel", pp)
    interleave = _positive("pipeline_parallel_interleave_num", interleave)
    num_layers = _positive("num_hidden_layers", num_layers)
    virtual = pp * interleave
    if spec is None:
        raise PipelineConfigError(
            "pipeline_parallel > 1 needs pipeline_parallel_layers_per_stage: 'auto' or a list of layer ranges "
            "per stage (e.g. ['0-1, 4-5', '2-3, 6-7'])"
        )
    if isinstance(spec, str):
        if spec.strip() != "auto":
            raise PipelineConfigError(
                f"pipeline_parallel_layers_per_stage must be 'auto' or a list of {pp} range strings, got {spec!r}"
            )
        if num_layers % virtual:
            raise PipelineConfigError(
                f"pipeline_parallel_layers_per_stage auto needs num_hidden_layers ({num_layers}) divisible by "
                f"pipeline_parallel*interleave_num ({pp}*{interleave} = {virtual}); list each stage's layer "
                f"ranges explicitly instead, e.g. {_example(num_layers, pp, interleave)}"
            )
        per = num_layers // virtual
        layers = tuple(tuple(range(v * per, (v + 1) * per)) for v in range(virtual))
        return StageSplit(pp, interleave, num_layers, layers)
    if not isinstance(spec, (list, tuple)) or len(spec) != pp:
        got = f"{len(spec)} entries" if isinstance(spec, (list, tuple)) else repr(spec)
        raise PipelineConfigError(
            f"pipeline_parallel_layers_per_stage needs one entry per stage (pipeline_parallel = {pp}), got {got}"
        )
    by_virtual: dict[int, tuple[int, ...]] = {}
    for stage, entry in enumerate(spec):
        if not isinstance(entry, str):
            raise PipelineConfigError(
                f"pipeline_parallel_layers_per_stage[{stage}] must be a string of ranges like '0-1, 4-8', "
                f"got {type(entry).__name__} {entry!r}"
            )
        segments = entry.split(",")
        if len(segments) != interleave:
            raise PipelineConfigError(
                f"pipeline_parallel_layers_per_stage[{stage}] = {entry!r} has {len(segments)} range(s); "
                f"pipeline_parallel_interleave_num = {interleave} needs exactly {interleave}"
            )
        for k, seg in enumerate(segments):
            match = _RANGE.match(seg)
            if match is None:
                raise PipelineConfigError(
                    f"pipeline_parallel_layers_per_stage[{stage}]: {seg.strip()!r} is not a layer 'n' or a "
                    f"closed range 'start-end'"
                )
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) is not None else start
            if end < start:
                raise PipelineConfigError(
                    f"pipeline_parallel_layers_per_stage[{stage}]: range {seg.strip()!r} ends before it starts; "
                    f"write it as '{end}-{start}'"
                )
            if end >= num_layers:
                raise PipelineConfigError(
                    f"pipeline_parallel_layers_per_stage[{stage}]: range {seg.strip()!r} names layer {end} but the "
                    f"model has {num_layers} layers (0-{num_layers - 1})"
                )
            by_virtual[k * pp + stage] = tuple(range(start, end + 1))
    order = [layer for v in range(virtual) for layer in by_virtual[v]]
    if order != list(range(num_layers)):
        seen: set[int] = set()
        twice = sorted({x for x in order if x in seen or seen.add(x)})  # type: ignore[func-returns-value]
        missing = sorted(set(range(num_layers)) - set(order))
        detail = []
        if twice:
            detail.append(f"layers {twice} appear more than once")
        if missing:
            detail.append(f"layers {missing} are missing")
        if not detail:
            detail.append("the ranges are not in increasing order of virtual stage (segment k of stage i is "
                          "virtual stage k*pp+i)")
        raise PipelineConfigError(
            f"pipeline_parallel_layers_per_stage must cover layers 0-{num_layers - 1} exactly once in increasing "
            f"order of virtual stage: {'; '.join(detail)}; read in virtual-stage order it gives {order}"
        )
    return StageSplit(pp, interleave, num_layers, tuple(by_virtual[v] for v in range(virtual)))


def _example(num_layers: int, pp: int, interleave: int) -> list[str]:
    """An explicit split of ``num_layers`` as even as it goes (earlier virtual stages get one more)."""
    virtual = pp * interleave
    base, extra = divmod(num_layers, virtual)
    sizes = [base + (1 if v < extra else 0) for v in range(virtual)]
    starts = [sum(sizes[:v]) for v in range(virtual)]
    out = []
    for i in range(pp):
        segs = []
        for k in range(interleave):
            v = k * pp + i
            a, b = starts[v], starts[v] + sizes[v] - 1
            segs.append(f"{a}-{b}" if b > a else str(a))
        out.append(", ".join(segs))
    return out
