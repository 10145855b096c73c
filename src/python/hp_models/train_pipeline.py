"""The trainer's model under pipeline parallelism: this rank's stages of Qwen3.5, their schedule,
and one module that holds them under the whole model's parameter names.

``PipelinedModel`` cuts the seeded whole model by the job's split, parallelizes each stage on the
dense mesh (TP inside it, FSDP/HSDP over the data-parallel ranks), and steps ``Schedule1F1B`` (or
``ScheduleInterleaved1F1B`` with more than one chunk per rank) over the rank's rows of the
global batch: its ``accumulation`` micro-steps' rows, in the order the data-parallel trainer
uses them, are the schedule's microbatches, so every rank trains on the samples it trains on
without pipelining.  The module tree is the whole model's, holding only this rank's parts
(``model.embed_tokens`` on the first stage, ``model.layers.<i>`` by their index in the whole
model, ``model.norm`` and ``lm_head`` on the last), so its state dict and its optimizer state
carry the whole model's names: a checkpoint saved at one pp loads at another (the ranks of
other stages hold the other names).

Each stage is parallelized in torchtitan's order: TP, then context parallelism, then the job's
activation checkpointing, then FSDP/HSDP.  Under context parallelism (``context_parallel`` > 1)
the ranks of a stage that share the data-parallel coordinates are its CP group: every
microbatch's sequence is split over them, the stages exchange each CP rank's share of the hidden
states, the stages' layers read each microbatch's sequence facts (length, document ends of
packed data) from a ``MicrobatchFacts``, the last stage's loss is reduced over the CP group with
the whole sequence's token count, and FSDP shards over ``dp_shard * cp``.

The MoE model's stages are built by ``hp_models.train_moe_pipeline`` and handed in; its subclass
adds the router's load-balancing loss to each microbatch's objective (``_objective``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_cp import ContextParallel, actual_seq_len_from_eod
from hp_dtensor import DeviceMesh, DTensor
from hp_models.activation_checkpoint import checkpoint_model_blocks
from hp_models.job import TrainLayout
from hp_models.mixed_precision import fsdp_policy, is_mixed
from hp_models.qwen3_5 import cp_cross_entropy
from hp_models.qwen3_5.context_parallel import SequenceFacts
from hp_models.qwen3_5.pipeline import pipeline_qwen3_5
from hp_models.qwen3_5.pipeline_cp import MicrobatchFacts
from hp_models.synthetic import eod_token
from hp_models.train_context import context_mesh, packed
from hp_pp import PipelineSchedule, PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from hp_tp import loss_parallel


class _Part(nn.Module):
    """A node of the whole model's tree holding this rank's parts."""


StageBuilder = Callable[[ContextParallel | None, MicrobatchFacts | None], list[PipelineStage]]


class PipelinedModel(nn.Module):
    """``build``: builds and parallelizes this rank's stages, given the CP group and the
    microbatch facts under context parallelism (the MoE model's, ``hp_models.train_moe_pipeline``);
    None: the dense model's, built here."""

    def __init__(self, model: Any, layout: TrainLayout, mesh: DeviceMesh, build: StageBuilder | None = None) -> None:
        super().__init__()
        split = layout.split
        assert split is not None
        self.n_model_params = sum(p.numel() for p in model.parameters())
        self._vocab: int = model.config.vocab_size
        dims = layout.dims
        coord = mesh.get_coordinate()
        assert coord is not None
        self.dp_rank: int = coord[1] * dims.dp_shard + coord[2]
        self.cp: ContextParallel | None = None
        self._facts: MicrobatchFacts | None = None
        if layout.cp > 1:
            cp_split, cp_dims = context_mesh(layout)  # (pp, dp_replicate, dp_shard, cp..., tp)
            self.cp = ContextParallel(cp_split[cp_dims], layout.context)
            self._facts = MicrobatchFacts()
            cp_coord = cp_split.get_coordinate()
            assert cp_coord is not None
            self.dp_rank = cp_coord[1] * dims.dp_shard + cp_coord[2]
        if build is not None:
            stages = build(self.cp, self._facts)
        else:
            stages = pipeline_qwen3_5(
                model, split, mesh, reshard_after_forward=dims.reshard_after_forward,
                sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload, mp_policy=fsdp_policy(layout),
                cp=self.cp, facts=self._facts,
                # the stage's layers keep their index in the whole model: the job's choice of layers holds
                before_fsdp=lambda stage: checkpoint_model_blocks(stage, layout),
            )
        if self.cp is not None and layout.uses_fsdp and not layout.sum_gradients:
            # average over the data-parallel ranks only: each CP rank holds a share of one gradient
            for s in stages:
                s.module.set_gradient_divide_factor(float(layout.dp))
        self._layout = layout
        self._mesh = mesh
        self._first, self._last = stages[0].is_first, stages[-1].is_last
        self._losses: list[Any] = []
        # under mixed precision the last stage's logits are bf16; the loss takes them in float32
        self._float_logits = is_mixed(layout.param_dtype, layout.reduce_dtype)
        self._dp_scale = 1.0 / layout.dp if layout.sum_gradients and layout.uses_fsdp else 1.0
        m = layout.accumulation
        self.schedule: PipelineSchedule = (
            ScheduleInterleaved1F1B(stages, m, self._loss, overlap_p2p=layout.overlap_p2p) if len(stages) > 1
            else Schedule1F1B(stages[0], m, self._loss, overlap_p2p=layout.overlap_p2p)
        )
        if self._facts is not None:
            self._facts.follow(stages, self.schedule.plan.rank_actions(stages[0].pp_rank))
        body = _Part()
        layers = nn.ModuleDict()
        for s in stages:
            chunk: Any = s.module
            if s.is_first:
                body.embed_tokens = chunk.model.embed_tokens
            for name, layer in chunk.model.layers.items():
                layers[name] = layer
            if s.is_last:
                body.norm = chunk.model.norm
                self.lm_head = chunk.lm_head
        body.layers = layers
        body.rotary_emb = stages[0].module.model.rotary_emb
        self.model = body

    def _loss(self, logits: Any, target: Any) -> Any:
        """The loss of one microbatch (``_objective``), recorded for the report, then scaled by
        ``1 / dp`` when the data-parallel gradients are summed rather than averaged."""
        loss = self._objective(logits, target)
        value = loss.detach()
        self._losses.append(value.full_tensor() if isinstance(value, DTensor) else value)
        return loss * self._dp_scale if self._dp_scale != 1.0 else loss

    def _objective(self, logits: Any, target: Any) -> Any:
        """Cross entropy of one microbatch (vocab-parallel under TP; in float32 under mixed
        precision, as without pipelining)."""
        if self._float_logits and logits.dtype != torch.float32:
            logits = logits.float()
        if self.cp is not None:  # this CP rank's share of the logits and targets, whole over the vocab
            loss = cp_cross_entropy(logits, target, self.cp)
        elif isinstance(logits, DTensor):
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        return loss

    def train_step(self, dp_rank: int, ids: torch.Tensor, tgt: torch.Tensor) -> float:
        """One step of the schedule over this data-parallel rank's rows of the global batch; returns
        the mean loss over the whole global batch (the same on every rank)."""
        layout = self._layout
        rows = [layout.samples(dp_rank, micro) for micro in range(layout.accumulation)]
        self._losses = []
        args = [self._share(torch.cat([ids[r] for r in rows]))] if self._first else []
        target = self._share(torch.cat([tgt[r] for r in rows])) if self._last else None
        if self._facts is not None:
            self._facts.start([self._sequence_facts(ids[r]) for r in rows])
        self.schedule.step(*args, target=target)
        if self._facts is not None:
            self._facts.finish()
        # The last stage's ranks hold the losses (each rank of a TP and of a CP group the same
        # ones): the sum over every rank is tp * cp times the sum over the data-parallel ranks'
        # microbatches.
        summed = self._sum_over_ranks(float(sum(float(x) for x in self._losses)))
        return summed / (layout.tp * layout.cp * layout.dp * layout.accumulation)

    def _sum_over_ranks(self, local: float) -> float:
        """This rank's summed microbatch losses, summed over every rank."""
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total.item())

    def _share(self, rows: torch.Tensor) -> torch.Tensor:
        """This CP rank's share of the sequence of ``rows`` (all of it without CP)."""
        return self.cp.split(rows, dim=1) if self.cp is not None else rows

    def _sequence_facts(self, ids: torch.Tensor) -> SequenceFacts:
        """The whole sequence's length and, for packed documents, each row's document ends."""
        if not packed(self._layout):
            return SequenceFacts(seq_len=ids.shape[1])
        eod = eod_token(self._vocab)
        return SequenceFacts(seq_len=ids.shape[1], actual_seq_len=[actual_seq_len_from_eod(r, eod)
                                                                   for r in ids.tolist()])
