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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor
from hp_models.activation_checkpoint import checkpoint_model_blocks
from hp_models.job import TrainLayout
from hp_models.mixed_precision import fsdp_policy, is_mixed
from hp_models.qwen3_5.pipeline import pipeline_qwen3_5
from hp_pp import PipelineSchedule, Schedule1F1B, ScheduleInterleaved1F1B
from hp_tp import loss_parallel


class _Part(nn.Module):
    """A node of the whole model's tree holding this rank's parts."""


class PipelinedModel(nn.Module):
    def __init__(self, model: Any, layout: TrainLayout, mesh: DeviceMesh) -> None:
        super().__init__()
        split = layout.split
        assert split is not None
        self.n_model_params = sum(p.numel() for p in model.parameters())
        # [trainer-features] the whole model's layers, so a layer's index is its index in the model
        # (the wrap commutes with the TP and FSDP the split stages get: those are module hooks)
        checkpoint_model_blocks(model, layout)
        stages = pipeline_qwen3_5(
            model, split, mesh, reshard_after_forward=layout.dims.reshard_after_forward,
            sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload, mp_policy=fsdp_policy(layout),
        )
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
        """Cross entropy of one microbatch (vocab-parallel under TP; in float32 under mixed precision,
        as without pipelining), recorded for the report, then scaled by ``1 / dp`` when the
        data-parallel gradients are summed rather than averaged."""
        if self._float_logits and logits.dtype != torch.float32:
            logits = logits.float()
        if isinstance(logits, DTensor):
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        value = loss.detach()
        self._losses.append(value.full_tensor() if isinstance(value, DTensor) else value)
        return loss * self._dp_scale if self._dp_scale != 1.0 else loss

    def train_step(self, dp_rank: int, ids: torch.Tensor, tgt: torch.Tensor) -> float:
        """One step of the schedule over this data-parallel rank's rows of the global batch; returns
        the mean loss over the whole global batch (the same on every rank)."""
        layout = self._layout
        rows = [layout.samples(dp_rank, micro) for micro in range(layout.accumulation)]
        self._losses = []
        args = [torch.cat([ids[r] for r in rows])] if self._first else []
        target = torch.cat([tgt[r] for r in rows]) if self._last else None
        self.schedule.step(*args, target=target)
        # The last stage's ranks hold the losses (each rank of a TP group the same ones): the sum
        # over every rank is tp times the sum over the data-parallel ranks' microbatches.
        total = torch.tensor([float(sum(float(x) for x in self._losses))], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total.item()) / (layout.tp * layout.dp * layout.accumulation)
