"""The trainer's mixture-of-experts path: Qwen3.5-MoE under expert, tensor and data parallelism.

``--config tiny-moe`` (or a ``qwen3_5_moe`` config.json) trains the MoE model; ``expert_parallel``
(``--ep``) spreads its routed experts over that many ranks.  The model is built on two meshes from
the job's sizes (with the job's activation checkpointing of the decoder layers and its mixed
precision, as the dense model): the dense mesh ``[pp, dp_replicate, fsdp, tp]`` for everything but
the routed experts (tensor parallel with sequence parallel, as the dense model) and the sparse mesh
``[pp, dp_replicate, efsdp, ep]`` (``efsdp = dp_shard * tp // ep``) for the experts: sharded
over ``ep`` with tokens dispatched to them by all-to-all, and fully sharded over ``efsdp``, which
also sums their gradients over the ranks holding the same experts (with ``ep <= tp`` the experts
keep a TP split over ``etp`` and are fully sharded over ``edp``; with replicas both are HSDP).
Under TP the logits stay split over the vocab (loss parallel).  The loss of each forward is
the next-token cross entropy plus ``router_aux_loss_coef`` times the router's load-balancing
loss over that forward's tokens (all of its tensor-parallel group's).

Under context parallelism (``context_parallel`` > 1) the model is parallelized in the same order
as the dense one, TP and EP, then CP (``parallelize_qwen3_5_cp``), then activation checkpointing,
then FSDP over ``dp_shard * cp``: each rank runs its share of every sequence, dispatches its own
tokens to the experts of its ep group (which may span CP ranks: ``efsdp = dp_shard * cp * tp //
ep``), the cross entropy is reduced over the CP group with the whole sequence's token count, and
the router's load-balancing statistics are summed over the CP group (the blocks' ``token_mesh``),
so each forward's loss is that of its whole sequences.  With TP as well, TP runs without sequence
parallelism and the logits stay whole over the vocab, as for the dense model under CP; each MoE
block still runs on its TP rank's share of the CP rank's tokens (cut at entry, gathered at exit),
so the router's statistics are summed over the CP and TP ranks together.

Under pipeline parallelism (``pipeline_parallel`` > 1, also with CP) the stages are built and
parallelized by ``hp_models.train_moe_pipeline`` on the same meshes (``moe_meshes``).

Every step the routed token copies per expert and layer are summed over the ranks; the summary
prints their balance (fewest and most per expert, per step and over the run).
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hp_dtensor import DeviceMesh, DTensor
from hp_models.activation_checkpoint import checkpoint_model_blocks
from hp_models.job import TrainLayout
from hp_models.mixed_precision import fsdp_policy, logits_in_float32
from hp_models.qwen3_5 import Qwen3_5Config
from hp_models.qwen3_5.model import local
from hp_models.qwen3_5_moe import Qwen3_5MoeConfig, tiny_moe_config
from hp_tp import loss_parallel

TINY_MOE = "tiny-moe"


def config_from_name(name: str, layers: int | None) -> Qwen3_5MoeConfig | None:
    """``tiny-moe`` (with ``layers`` decoder layers when given) as a config; None for another name."""
    if name != TINY_MOE:
        return None
    return tiny_moe_config(num_hidden_layers=layers) if layers is not None else tiny_moe_config()


def config_from_file(path: str) -> Qwen3_5Config:
    """A HF config.json: the MoE config when its ``model_type`` is a ``qwen3_5_moe`` one, else dense."""
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
        kind = str(raw.get("model_type", "")) if isinstance(raw, dict) else ""
        if kind.startswith("qwen3_5_moe"):
            return Qwen3_5MoeConfig.from_hf_dict(raw)
    return Qwen3_5Config.from_json_file(path)  # (which names the file when it is missing)


def check_model(config: Qwen3_5Config, layout: TrainLayout, seq_len: int) -> None:
    """``ValueError`` for a tensor-parallel size the MoE model's shared expert cannot split, and,
    under context and tensor parallelism, for a sequence length whose CP shards the TP ranks
    cannot split (each MoE block runs on its TP rank's share of the CP rank's tokens)."""
    if isinstance(config, Qwen3_5MoeConfig):
        from hp_models.qwen3_5_moe.parallelize import check_moe_tp_size

        check_moe_tp_size(config, layout.tp)
        cp, tp = layout.cp, layout.tp
        if cp > 1 and tp > 1 and seq_len % (cp * tp):
            raise ValueError(
                f"--seq-len {seq_len} over context_parallel {cp} and tensor_parallel {tp}: each MoE block splits a "
                f"CP rank's {seq_len / cp:g} tokens over the {tp} TP ranks; use a --seq-len that is a multiple of "
                f"{cp * tp}"
            )


# ---------------------------------------------------------------- the balance of the experts
@dataclass
class ExpertLoad:
    """Routed token copies per (layer, expert), summed over every rank, one table per step."""

    layers: int
    experts: int
    steps: list[list[list[int]]] = field(default_factory=list)
    _step: torch.Tensor | None = None

    def add_forward(self, blocks: list[Any]) -> None:
        """Add this rank's counts of the forward just run."""
        self.add_counts(torch.stack([b.tokens_per_expert for b in blocks]))

    def add_counts(self, counts: torch.Tensor) -> None:
        """Add this rank's counts per (layer, expert), a ``(layers, experts)`` tensor."""
        counts = counts.detach().to(torch.float64)
        self._step = counts if self._step is None else self._step + counts

    def end_step(self, local_loss: float, world_size: int) -> float:
        """Close the step: sum its counts and ``local_loss`` over the ranks (one all-reduce);
        returns the summed loss."""
        assert self._step is not None, "end_step before any forward"
        packed = torch.cat([torch.tensor([local_loss], dtype=torch.float64), self._step.flatten()])
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(packed)
        self._step = None
        table = packed[1:].round().to(torch.int64).reshape(self.layers, self.experts)
        self.steps.append(table.tolist())
        return float(packed[0].item())

    def report(self) -> dict[str, Any]:
        """Per layer: the fewest and most copies any expert got in one step and over the run."""
        per_layer = []
        for layer in range(self.layers):
            rows = [step[layer] for step in self.steps]
            totals = [sum(col) for col in zip(*rows)]
            per_layer.append({
                "step_min": min(min(r) for r in rows), "step_max": max(max(r) for r in rows),
                "run_min": min(totals), "run_max": max(totals), "run_totals": totals,
            })
        routed = sum(self.steps[0][0]) if self.steps else 0
        return {"steps": len(self.steps), "experts": self.experts, "copies_per_step": routed,
                "per_layer": per_layer, "per_step": self.steps}


def describe_load(load: dict[str, Any]) -> list[str]:
    """The summary's lines on the experts' balance."""
    steps, experts, routed = load["steps"], load["experts"], load["copies_per_step"]
    layers = load["per_layer"]
    lines = [f"  tokens per expert ({experts} experts, {routed} routed token copies per layer per step, even share "
             f"{routed / experts:g}; over {steps} step(s)):"]
    for i, lay in enumerate(layers):
        lines.append(f"    layer {i}: per step min {lay['step_min']} max {lay['step_max']}; whole run min "
                     f"{lay['run_min']} max {lay['run_max']} (even {routed * steps / experts:g})")
    lines.append(f"    all layers: per step min {min(x['step_min'] for x in layers)} max "
                 f"{max(x['step_max'] for x in layers)}")
    return lines


# ---------------------------------------------------------------- one rank
@dataclass(frozen=True)
class MoeMeshes:
    """This rank's meshes of a MoE run: the dense mesh ``[pp, dp_replicate, fsdp, tp]``, the
    experts' ``ep`` and ``etp`` dims (None when 1 rank, or not split) and the mesh the experts
    are fully sharded over (``efsdp``, or ``edp`` under ``etp``; with ``dp_replicate`` as HSDP)."""

    dense: DeviceMesh
    ep: DeviceMesh | None
    etp: DeviceMesh | None
    expert_dp: DeviceMesh


def moe_meshes(layout: TrainLayout) -> MoeMeshes:
    """The ``MoeMeshes`` of ``layout`` (every rank builds them, in the same order)."""
    from hp_dtensor import init_device_mesh

    dims = layout.dims
    moe = layout.moe
    assert moe is not None
    dense, sparse = dims.build_mesh("cpu")
    if moe.etp > 1:
        # ep <= tp: the experts keep a TP split over the etp ranks (the TP ranks sharing an ep
        # coordinate) and are fully sharded over what is left of efsdp, edp.
        experts = init_device_mesh("cpu", dims.expert_mesh_shape(),
                                   mesh_dim_names=("pp", "dp_replicate", "edp", "etp", "ep"))
        return MoeMeshes(dense, experts["ep"], experts["etp"],
                         experts["dp_replicate", "edp"] if dims.dp_replicate > 1 else experts["edp"])
    if sparse is None:  # ep == 1: the experts are still summed and sharded over efsdp = dp_shard * tp
        sparse = init_device_mesh("cpu", dims.sparse_mesh_shape(), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return MoeMeshes(dense, sparse["ep"] if dims.ep > 1 else None, None,
                     sparse["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else sparse["efsdp"])


def build_moe_model(seed: int, layout: TrainLayout, config: Qwen3_5MoeConfig, *,
                    distributed: bool) -> tuple[Any, int]:
    """The seeded MoE model, with TP on the dense mesh, EP on the sparse mesh (and, with
    ``ep <= tp``, a TP split of the experts over ``etp``) and FSDP (dense parameters over the
    data-parallel ranks, experts over ``efsdp``, or ``edp`` under ``etp``; HSDP with replicas over
    ``dp_replicate`` for both) as ``layout`` says, and this rank's data-parallel index.  The
    model carries its ``ExpertLoad`` as ``expert_load``."""
    torch.manual_seed(seed)
    model = config.build()
    model.init_weights()
    model.expert_load = ExpertLoad(config.num_hidden_layers, config.num_experts)
    if not distributed:
        checkpoint_model_blocks(model, layout)
        return model, 0
    from hp_models.qwen3_5_moe.fsdp import apply_fsdp_qwen3_5_moe
    from hp_models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe

    dims = layout.dims
    moe = layout.moe
    assert moe is not None
    meshes = moe_meshes(layout)
    if layout.split is not None:
        from hp_models.train_moe_pipeline import MoePipelinedModel

        pipelined = MoePipelinedModel(model, layout, meshes)
        return pipelined, pipelined.dp_rank
    dense, ep_mesh, etp_mesh, expert_dp = meshes.dense, meshes.ep, meshes.etp, meshes.expert_dp
    coord = dense.get_coordinate()
    assert coord is not None
    # Under TP the logits stay split over the vocab (loss parallel), as in the dense trainer; under
    # CP they stay whole (the CP loss reduces over the CP ranks itself) and sequence parallelism,
    # on with TP, is ignored with a warning, shown by rank 0 only.
    with warnings.catch_warnings():
        if dense.get_rank() != 0:
            warnings.simplefilter("ignore", UserWarning)
        parallelize_qwen3_5_moe(model, tp_mesh=dense["tp"] if dims.tp > 1 else None, ep_mesh=ep_mesh,
                                etp_mesh=etp_mesh, loss_parallel=dims.tp > 1 and dims.cp == 1,
                                context_parallel=dims.cp, dispatcher=moe.dispatcher,
                                npu_nums_per_device=moe.npu_nums_per_device)
    if dims.cp > 1:
        _context_parallel(model, layout)
    # after TP, EP and CP (their collectives, the token all-to-alls included, rerun in the
    # recomputation on every rank in the same order), before FSDP
    checkpoint_model_blocks(model, layout)
    if dims.dp_shard * dims.cp > 1 or expert_dp.size() > 1:
        # with replicas (HSDP) both meshes are 2-D: (dp_replicate, shard dim)
        dense_dp = dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else dense["fsdp"]
        apply_fsdp_qwen3_5_moe(model, dense_dp, expert_dp, reshard_after_forward=dims.reshard_after_forward,
                               sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload,
                               mp_policy=fsdp_policy(layout))
        if dims.cp > 1 and not layout.sum_gradients:
            # average over the data-parallel ranks only (dense and expert groups): each CP rank
            # holds a share of one gradient
            model.set_gradient_divide_factor(float(layout.dp))
        logits_in_float32(model, layout)
    # (the CP ranks are innermost in fsdp = dp_shard * cp)
    return model, coord[1] * dims.dp_shard + coord[2] // dims.cp


def _context_parallel(model: Any, layout: TrainLayout) -> None:
    """Context parallelism of the MoE model on this rank's CP group (see the module's docstring);
    the ``ContextParallel`` is kept as ``model.context_parallel`` for the step."""
    from hp_cp import ContextParallel
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import parallelize_qwen3_5_cp
    from hp_models.train_context import context_mesh

    d = layout.dims
    split, cp_dims = context_mesh(layout)
    cp = ContextParallel(split[cp_dims], layout.context)
    parallelize_qwen3_5_cp(model, cp)
    # the router's statistics are summed over the whole CP group (hybrid's two dims as one) and,
    # under TP, its TP ranks, each of which routes its share of the CP rank's tokens
    whole = init_device_mesh("cpu", (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp),
                             mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    tokens = whole["cp", "tp"] if d.tp > 1 else whole["cp"]
    for block in model.moe_blocks():
        block.token_mesh = tokens
    object.__setattr__(model, "context_parallel", cp)


def moe_train_step(model: Any, layout: TrainLayout, dp_rank: int, ids: torch.Tensor, tgt: torch.Tensor) -> float:
    """One optimizer step's forwards and backwards over this rank's rows of the global batch
    (``ids``/``tgt``); returns the mean loss (LM + weighted router loss) over the step's forwards,
    the same on every rank.  Gradients are those of that mean, left for the optimizer."""
    config: Qwen3_5MoeConfig = model.config
    load: ExpertLoad = model.expert_load
    fsdp = hasattr(model, "set_requires_gradient_sync")
    scale = layout.loss_scale()
    blocks = model.moe_blocks()
    cp = getattr(model, "context_parallel", None)
    total = 0.0
    for micro in range(layout.accumulation):
        rows = layout.samples(dp_rank, micro)
        if fsdp:
            # Only the last micro-step's backward reduces the gradients; before it they accumulate locally.
            model.set_requires_gradient_sync(micro == layout.accumulation - 1)
        if cp is not None:  # this rank's share of the sequences; the loss of the whole ones
            from hp_models.qwen3_5 import cp_cross_entropy

            logits = model(cp.split(ids[rows], dim=1))
            loss = cp_cross_entropy(logits, cp.split(tgt[rows], dim=1), cp) + \
                config.router_aux_loss_coef * model.aux_loss()
            (loss * scale if scale != 1.0 else loss).backward()
            total += float(loss.item())
            load.add_forward(blocks)
            continue
        logits = model(ids[rows])
        with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
            # under TP the logits are split over the vocab: the loss is assembled from the shards
            # (a replicated scalar, taken as this rank's value to add the router's plain loss)
            ce = local(F.cross_entropy(logits.flatten(0, 1).float(), tgt[rows].flatten()))
            loss = ce + config.router_aux_loss_coef * model.aux_loss()
            (loss * scale if scale != 1.0 else loss).backward()
        total += float(loss.item())
        load.add_forward(blocks)
    summed = load.end_step(total, layout.world_size)
    # Each rank of a tensor- and context-parallel group holds the same loss: the sum over all ranks
    # is tp * cp times the sum over the data-parallel ranks.
    ranks = layout.world_size if layout.world_size > 1 else 1
    return summed / (ranks * layout.accumulation)


def run_report(model: Any) -> dict[str, Any]:
    """What the run's summary and log add for a MoE model (nothing for a dense one)."""
    load = getattr(model, "expert_load", None)
    return {"tokens_per_expert": load.report()} if isinstance(load, ExpertLoad) and load.steps else {}


__all__ = [
    "TINY_MOE", "ExpertLoad", "build_moe_model", "check_model", "config_from_file", "config_from_name",
    "describe_load", "moe_train_step", "run_report",
]
