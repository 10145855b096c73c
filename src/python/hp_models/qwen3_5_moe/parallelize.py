"""Tensor and expert parallelism for the Qwen3.5 MoE model (the composed EP x TP application).

Everything but the MoE blocks follows the dense Qwen3.5 plan on the ``tp`` mesh (sequence
parallel, attention and Gated DeltaNet split by head).  Each MoE block runs on the tokens of this
rank's sequence shard -- it is token-wise, so it never gathers the sequence.  Without sequence
parallelism (under context parallelism, which splits the sequence over the CP ranks instead) the
activations between blocks are replicated over ``tp`` and each block cuts its rank's shard at
entry and gathers its output at exit, so inside it the tokens are split as under sequence
parallelism (as torchtitan splits the routed tokens over the TP ranks):

- the router and the shared-expert gate keep replicated weights, used on local tokens (their
  gradients are partial sums over ``tp``);
- the shared expert is a dense MLP, split over ``tp`` like the dense MLP (the shard's tokens are
  gathered at its entry and its output reduce-scattered back);
- the routed experts are stacked and sharded over the ``ep`` dim of the sparse mesh
  ``[pp, dp_replicate, efsdp, ep]``; every rank dispatches its own tokens within its ep group.

The sparse mesh orders ranks like the dense one with ``ep`` innermost, so with ``ep <= tp`` an ep
group lies inside one TP group and the remaining ``etp = tp // ep`` TP ranks are part of
``efsdp``: by default they hold the same experts (split by FSDP when it is applied); given an
``etp_mesh`` over them, each expert keeps that part of the TP split (``ExpertTensorParallel``:
gate/up by column, down by row).  With ``ep > tp`` the ep group spans several TP groups, so EP runs
across the TP ranks.  Every layout equals one process.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor import DeviceMesh, Placement, Replicate, Shard
from hp_dtensor.platform import current as _platform
from hp_ep import (
    ExpertParallelStyle,
    ExpertTensorParallel,
    TokenDispatcher,
    ep_etp_mesh,
    make_expert_parallel,
)
from hp_models.qwen3_5.model import decoder_layers
from hp_models.qwen3_5.parallelize import parallelize_qwen3_5_tp
from hp_models.qwen3_5_moe.config import Qwen3_5MoeConfig
from hp_tp import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)


def check_moe_tp_size(config: Qwen3_5MoeConfig, tp: int) -> None:
    """``ValueError`` naming the shared expert's width when ``tp`` does not divide it."""
    if config.shared_expert_intermediate_size % tp:
        raise ValueError(
            f"tp={tp} does not divide shared_expert_intermediate_size={config.shared_expert_intermediate_size}; "
            f"pick a tp that divides it"
        )


def _moe_block_plan(seq: Placement) -> dict[str, ParallelStyle]:
    """The MoE block's styles for activations ``seq`` between blocks: ``Shard(1)`` (sequence
    parallel) or ``Replicate()`` (without it, under context parallelism).  Either way the block
    runs on ``1 / tp`` of the tokens, its rank's sequence shard: without sequence parallelism the
    replicated input is cut at entry (no communication) and the output gathered back, so the
    experts, the router and the dispatch see the tokens exactly as under sequence parallelism,
    no token runs through them twice."""
    if seq != Shard(1) and seq != Replicate():
        raise ValueError(f"the MoE plan takes activations Shard(1) or Replicate() between blocks, got {seq}")
    return {
        # The block sees this rank's sequence shard as a plain tensor and returns it as ``seq``.
        "mlp": PrepareModuleInputOutput(
            input_layouts=seq, desired_input_layouts=Shard(1), use_local_input=True,
            output_layouts=Shard(1), desired_output_layouts=seq, use_local_output=False,
        ),
        # The block flattens its tokens to (tokens, hidden): the shard's rows are gathered here.
        "mlp.shared_expert": PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
        "mlp.shared_expert.gate_proj": ColwiseParallel(),
        "mlp.shared_expert.up_proj": ColwiseParallel(),
        "mlp.shared_expert.down_proj": RowwiseParallel(output_layouts=Shard(0), use_local_output=True),
    }


def parallelize_qwen3_5_moe(
    model: Any, *, tp_mesh: DeviceMesh | None = None, ep_mesh: DeviceMesh | None = None,
    loss_parallel: bool = False, dispatcher: TokenDispatcher = TokenDispatcher.ALLTOALL,
    npu_nums_per_device: int = 8, etp_mesh: DeviceMesh | None = None, sequence_parallel: bool = True,
    context_parallel: int = 1,
) -> list[ExpertParallelStyle]:
    """Apply TP on the 1-D ``tp_mesh`` and EP on the 1-D ``ep_mesh`` (the
    sparse mesh's ``ep`` dim) in place; either may be None.  ``dispatcher`` picks how tokens reach
    the experts: ``ALLTOALL`` (``ExpertParallel``) or ``ALLTOALL_DEREDUNDANCY``
    (``DeredundancyExpertParallel``, nodes of ``npu_nums_per_device`` ep ranks; ``ValueError``
    naming both numbers unless that divides the ep size).  Returns each MoE block's style in layer
    order (their ``plans`` hold each forward's token counts).

    ``etp_mesh`` (a 1-D dim sliced from the same mesh as ``ep_mesh``, which may then have size 1):
    with more than one rank, the experts are also split inside over it (``ExpertTensorParallel``:
    gate/up by column, down by row), so a rank holds ``1 / (ep * etp)`` of them; the ``etp`` ranks
    are the TP ranks sharing an ep coordinate when ``ep < tp`` (``etp = tp // ep``).  Plain
    all-to-all only (``ValueError`` with ``ALLTOALL_DEREDUNDANCY``).

    ``sequence_parallel`` and ``context_parallel`` are the dense plan's
    (``parallelize_qwen3_5_tp``; with ``context_parallel > 1``, whose ranks already split the
    sequence, sequence parallelism is off, with a warning when asked for).  Without sequence
    parallelism the activations between blocks are replicated over ``tp`` and each MoE block
    still runs on ``1 / tp`` of its rank's tokens (cut at entry, gathered at exit), so the
    sequence length a rank holds must be a multiple of ``tp`` (the trainer refuses other lengths
    before any rank starts).  The blocks' ``token_mesh`` is ``tp_mesh``: a caller who adds CP
    widens it to the CP and TP ranks (the router's statistics are summed over both).

    Logits come back as a ``Replicate()`` DTensor under TP (``Shard(-1)`` over the vocab when
    ``loss_parallel``).  Data-parallel gradient reduction is not done here: dense gradients are
    summed over the dense mesh's data-parallel dims, expert gradients over ``efsdp`` (FSDP does
    both)."""
    config: Qwen3_5MoeConfig = model.config
    layers: list[Any] = decoder_layers(model.model)  # (a pipeline stage holds some, by their index)
    if tp_mesh is not None and tp_mesh.size() > 1:
        check_moe_tp_size(config, tp_mesh.size())
        parallelize_qwen3_5_tp(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                               context_parallel=context_parallel, mlp_plan=_moe_block_plan)
        plat = _platform()
        for layer in layers:
            block = layer.mlp
            for gate in (block.gate, block.shared_expert_gate):
                plat.set_param(gate, "weight", plat.distribute_tensor(gate.weight.data, tp_mesh, [Replicate()]))
            block.token_mesh = tp_mesh
    styles: list[ExpertParallelStyle] = []
    if etp_mesh is not None and etp_mesh.size() > 1:
        if ep_mesh is None or dispatcher is not TokenDispatcher.ALLTOALL:
            raise ValueError(
                f"expert tensor parallelism (etp_mesh of {etp_mesh.size()} ranks) needs an ep_mesh from the same mesh "
                f"(size 1 allowed) and the alltoall dispatcher, got "
                f"{'no ep_mesh' if ep_mesh is None else f'an ep_mesh of {ep_mesh.size()} ranks'} and {dispatcher}"
            )
        mesh = ep_etp_mesh(ep_mesh, etp_mesh)
        for layer in layers:
            etp_style = ExpertTensorParallel()
            etp_style.apply(layer.mlp.experts, mesh)  # a 2-D style: parallelize_module takes 1-D meshes
            styles.append(etp_style)
        return styles
    if ep_mesh is not None and ep_mesh.size() > 1:
        for layer in layers:
            style = make_expert_parallel(dispatcher, npu_nums_per_device=npu_nums_per_device)
            parallelize_module(layer.mlp, ep_mesh, {"experts": style})
            styles.append(style)
    return styles


__all__ = ["check_moe_tp_size", "parallelize_qwen3_5_moe"]
