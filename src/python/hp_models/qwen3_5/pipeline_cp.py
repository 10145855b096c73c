"""Qwen3.5 pipeline stages under context parallelism (PP x CP, as torchtitan composes them).

The ranks of one pipeline stage that share the data-parallel coordinates form a CP group: each
microbatch's sequence is split over them with the load-balanced split, every stage computes on
its CP rank's share, and what one stage sends the next over P2P is that share of the hidden
states (B, S / cp, hidden).  Under tensor parallelism sequence parallelism is off (CP already
splits the sequence), so the activations are replicated over the tp ranks and travel as each
rank's whole local tensor.

A stage past the first receives hidden states, not tokens: it cannot find the sequence's
length or its document ends from its input.  ``MicrobatchFacts`` carries them: the trainer,
which draws the whole batch on every rank, sets each microbatch's ``SequenceFacts`` before the
step, and each stage takes its microbatch's in the order the schedule's plan runs the stage's
forwards.  The facts then travel with each decoder layer's inputs (as without pipelining), so an
activation-checkpointed layer recomputes with its own forward's facts.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hp_cp import ContextParallel
from hp_dtensor import DTensor, Replicate
from hp_models.qwen3_5.context_parallel import SequenceFacts, cp_rotary, parallelize_layers_cp
from hp_models.qwen3_5.pipeline import Qwen3_5Stage
from hp_pp import Action, ActionKind, PipelineStage


class MicrobatchFacts:
    """The ``SequenceFacts`` of each microbatch of a pipeline step, for this rank's stages (see
    the module's docstring): ``follow`` the plan once, ``start`` each step with every
    microbatch's facts, ``finish`` it to check that every stage took each microbatch's once."""

    def __init__(self) -> None:
        self._order: dict[Any, list[int]] = {}  # stage module -> microbatch of its k-th forward
        self._facts: list[SequenceFacts] = []
        self._taken: dict[Any, int] = {}

    def follow(self, stages: Sequence[PipelineStage], actions: Iterable[Action]) -> None:
        """Read from this rank's ``actions`` of the schedule's plan which microbatch each of
        ``stages`` runs at each of its forwards."""
        by_index = {s.stage_index: s.module for s in stages}
        order: dict[Any, list[int]] = {m: [] for m in by_index.values()}
        for a in actions:
            if a.kind is ActionKind.F:
                order[by_index[a.stage]].append(a.microbatch)
        self._order = order

    def start(self, facts: Sequence[SequenceFacts]) -> None:
        """A step begins: ``facts[i]`` describes microbatch ``i``."""
        self._facts = list(facts)
        self._taken = dict.fromkeys(self._order, 0)

    def take(self, stage: Any) -> SequenceFacts:
        """The facts of the microbatch whose forward the stage module ``stage`` runs now."""
        order = self._order.get(stage)
        if order is None:
            raise RuntimeError("this stage module is not one of the stages MicrobatchFacts.follow was given")
        k = self._taken[stage]
        if k >= len(order) or order[k] >= len(self._facts):
            raise RuntimeError(
                f"a stage ran forward {k + 1} of a step whose plan has {len(order)} for it and {len(self._facts)} "
                f"microbatches' facts; call MicrobatchFacts.start before each step"
            )
        self._taken[stage] = k + 1
        return self._facts[order[k]]

    def finish(self) -> None:
        """The step ended: every stage must have run every forward of the plan."""
        short = [f"{n} of {len(self._order[m])}" for m, n in self._taken.items() if n != len(self._order[m])]
        if short:
            raise RuntimeError(f"pipeline stages ran {', '.join(short)} planned forwards this step")


def parallelize_qwen3_5_stage_cp(stage: Qwen3_5Stage, cp: ContextParallel, facts: MicrobatchFacts) -> Qwen3_5Stage:
    """Apply context parallelism to the pipeline stage ``stage`` in place (after the TP plan,
    without sequence parallelism or loss parallel, and before activation checkpointing and
    ``fully_shard``); returns it.  Its forward then takes this CP rank's share: of the tokens (first stage,
    ``cp.split(input_ids, dim=1)``) or of the previous stage's hidden states, and returns its
    share of the hidden states or (last stage) of the logits; the sequence facts come from
    ``facts``."""
    body: Any = stage.model
    parallelize_layers_cp(list(body.layers.values()), cp)

    def stage_forward(self: Qwen3_5Stage, x: torch.Tensor) -> torch.Tensor:
        tokens = facts.take(self)
        body: Any = self.model
        like = x  # this rank's share (B, S / cp, ...), a plain tensor
        if tokens.seq_len != x.shape[1] * cp.cp:
            raise ValueError(
                f"the stage's input holds {x.shape[1]} tokens per row but the microbatch's sequence of "
                f"{tokens.seq_len} over context_parallel {cp.cp} gives {tokens.seq_len // cp.cp}"
            )
        if self.first:
            x = body.embed_tokens(x)
        elif self.tp_mesh is not None:
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()])  # no sequence parallelism under CP
        cos, sin = cp_rotary(body.rotary_emb, cp, tokens, like, x.dtype)
        for layer in body.layers.values():
            x = layer(x, cos, sin, tokens=tokens)
        if self.last:
            head: Any = self.lm_head
            return head(body.norm(x))  # type: ignore[no-any-return]
        return x.to_local() if isinstance(x, DTensor) else x

    object.__setattr__(stage, "forward", types.MethodType(stage_forward, stage))
    return stage
