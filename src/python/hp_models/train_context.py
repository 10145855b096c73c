"""The trainer under context parallelism, and on packed documents (EOD data).

``check_context`` runs before any rank starts: what context parallelism would refuse on every
rank (a framework hp_cp has no code for, a sequence the load-balanced split cannot cut, heads
Ulysses cannot split, chunks shorter than the Gated DeltaNet convolution's reach), with the sizes.

``ContextParallelModel`` builds the seeded whole model on the ranks: the tensor-parallel plan
(sequence parallelism is ignored under CP, with a warning), then ``parallelize_qwen3_5_cp`` over
the CP mesh, then the job's activation checkpointing, then FSDP (with the job's mixed precision)
over ``dp_shard * cp`` (``fsdp``, also when ``dp_shard`` is 1: the CP
ranks shard the parameters too, and the reduce-scatter sums each CP rank's share of the
gradient).  Its ``train_step`` splits each micro-step's rows along the sequence, passes the
compressed EOD mask (``actual_seq_len``, found from the EOD tokens) when the data are packed, and
reduces the loss over the CP ranks with the whole sequence's token count.  The module holds the
whole model's parts under their own names, so checkpoints keep the names of every other layout.

Without context parallelism packed documents still never attend across a boundary:
``documents_as_rows`` turns each document into a row of its own (right-padded, the padding's
targets ignored), which a causal model computes exactly as it would inside the packed row.  That
is also the one-process reference the CP runs are compared with.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from hp_cp import ContextParallel, CPMethod, MaskCompression, actual_seq_len_from_eod, check_seq_len
from hp_dtensor import DeviceMesh, init_device_mesh
from hp_models.activation_checkpoint import checkpoint_model_blocks
from hp_models.job import TrainLayout
from hp_models.mixed_precision import fsdp_policy, logits_in_float32
from hp_models.qwen3_5 import (
    Qwen3_5Config,
    apply_fsdp_qwen3_5,
    cp_cross_entropy,
    parallelize_qwen3_5_cp,
    parallelize_qwen3_5_tp,
)
from hp_models.synthetic import eod_token


def packed(layout: TrainLayout) -> bool:
    """The job's data are packed documents (``create_compressed_eod_mask``)."""
    return layout.context.compression is MaskCompression.EOD


def check_context(layout: TrainLayout, config: Qwen3_5Config, seq_len: int) -> None:
    """Refuse, before any rank starts, a context-parallel run the ranks would refuse: raises
    ``NotImplementedError`` on a framework hp_cp has no code for, ``ValueError`` naming the sizes
    otherwise."""
    cp = layout.cp
    if cp == 1:
        return
    from hp_cp.platform import framework_module

    try:
        framework_module("context parallelism")
    except NotImplementedError as e:
        raise NotImplementedError(f"context_parallel {cp}: {e}; or set context_parallel: 1") from None
    check_seq_len(seq_len, cp)
    chunk = seq_len // (2 * cp)
    reach = config.linear_conv_kernel_dim - 1
    if "linear_attention" in (config.layer_types or []) and chunk < reach:
        raise ValueError(
            f"--seq-len {seq_len} over context_parallel {cp} gives chunks of {chunk} tokens, but the Gated DeltaNet "
            f"convolution reads {reach} previous tokens across a chunk boundary; use --seq-len of at least "
            f"{2 * cp * reach}"
        )
    # Ulysses splits the heads each tensor-parallel rank holds
    heads, kv_heads = config.num_attention_heads // layout.tp, config.num_key_value_heads // layout.tp
    try:
        layout.context.check_heads(heads, kv_heads)
    except ValueError as e:
        where = f" (num_attention_heads {config.num_attention_heads} over tensor_parallel {layout.tp})" \
            if layout.tp > 1 else ""
        raise ValueError(f"{e}{where}") from None


def documents_as_rows(ids: torch.Tensor, tgt: torch.Tensor, vocab: int, multiple: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``ids``/``tgt`` (B, S) as one row per document (documents end after each EOD
    token), right-padded to the longest document rounded up to ``multiple`` (sequence parallelism
    splits the rows' length); padded targets are ``-100`` (ignored by the loss).  The mean loss
    over the result is the mean over the packed tokens."""
    eod = eod_token(vocab)
    docs = [(r, a, e) for r in range(ids.shape[0])
            for a, e in _spans(actual_seq_len_from_eod(ids[r].tolist(), eod))]
    longest = max(e - a for _, a, e in docs)
    longest = -(-longest // multiple) * multiple
    rows = torch.zeros(len(docs), longest, dtype=ids.dtype)
    targets = torch.full((len(docs), longest), -100, dtype=tgt.dtype)
    for i, (r, a, e) in enumerate(docs):
        rows[i, :e - a] = ids[r, a:e]
        targets[i, :e - a] = tgt[r, a:e]
    return rows, targets


def _spans(ends: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *ends[:-1]], ends))


class _Part(nn.Module):
    """A node of the whole model's tree."""


class ContextParallelModel(nn.Module):
    """The whole model under context parallelism on this rank (see the module's docstring)."""

    _whole: Any  # the parallelized whole model, called by ``forward`` (its parts are the children)

    def __init__(self, model: Any, layout: TrainLayout, dense: DeviceMesh) -> None:
        super().__init__()
        dims = layout.dims
        self._layout = layout
        self._vocab: int = model.config.vocab_size
        self.n_model_params = sum(p.numel() for p in model.parameters())
        split, cp_dims = context_mesh(layout)
        self.cp = ContextParallel(split[cp_dims], layout.context)
        coord = split.get_coordinate()
        assert coord is not None
        self.dp_rank: int = coord[1] * dims.dp_shard + coord[2]
        if dims.tp > 1:
            # the logits stay whole over the vocab: the CP loss reduces over the CP ranks itself.
            # Sequence parallelism, on with TP, is ignored under CP with a warning: shown by rank 0 only.
            with warnings.catch_warnings():
                if dense.get_rank() != 0:
                    warnings.simplefilter("ignore", UserWarning)
                parallelize_qwen3_5_tp(model, dense["tp"], loss_parallel=False, context_parallel=dims.cp)
        parallelize_qwen3_5_cp(model, self.cp)
        checkpoint_model_blocks(model, layout)  # after TP and CP (both recomputed), before FSDP
        dp_mesh = dense["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else dense["fsdp"]
        apply_fsdp_qwen3_5(model, dp_mesh, reshard_after_forward=dims.reshard_after_forward,
                           sum_gradients=layout.sum_gradients, cpu_offload=layout.cpu_offload,
                           mp_policy=fsdp_policy(layout))
        logits_in_float32(model, layout)
        if not layout.sum_gradients:
            # average over the data-parallel ranks only: each CP rank holds a share of one gradient
            model.set_gradient_divide_factor(float(layout.dp))
        object.__setattr__(self, "_whole", model)  # not registered as a child: its parts are, below
        self.model = model.model
        self.lm_head = model.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the logits of the rows ``ids`` (B, S)."""
        actual = self._documents(ids)
        out: torch.Tensor = self._whole(self.cp.split(ids, dim=1), actual_seq_len=actual)
        return out

    def _documents(self, ids: torch.Tensor) -> list[list[int]] | None:
        if not packed(self._layout):
            return None
        eod = eod_token(self._vocab)
        return [actual_seq_len_from_eod(row, eod) for row in ids.tolist()]

    def train_step(self, dp_rank: int, ids: torch.Tensor, tgt: torch.Tensor) -> float:
        """One step's forward and backward over this data-parallel rank's rows of the global batch
        ``ids``/``tgt``; returns the mean loss over the whole global batch (the same on every
        rank).  Gradients are left for the optimizer: those of the global mean loss."""
        layout = self._layout
        scale = layout.loss_scale()
        total = 0.0
        for micro in range(layout.accumulation):
            rows = layout.samples(dp_rank, micro)
            # only the last micro-step's backward reduces the gradients
            self._whole.set_requires_gradient_sync(micro == layout.accumulation - 1)
            logits = self(ids[rows])
            loss = cp_cross_entropy(logits, self.cp.split(tgt[rows], dim=1), self.cp)
            (loss * scale if scale != 1.0 else loss).backward()
            total += float(loss.detach().item())
        import torch.distributed as dist

        # every rank of a CP and TP group holds the same loss: the sum over all ranks is cp * tp
        # times the sum over the data-parallel ranks
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / (layout.world_size * layout.accumulation)


def context_mesh(layout: TrainLayout) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The ranks of the dense mesh ``(pp, dp_replicate, fsdp, tp)`` again with ``fsdp`` split
    into ``dp_shard`` and the CP dims (one, or ``(ring, ulysses)`` for hybrid), CP innermost in
    ``fsdp`` as the dense mesh's row-major order has it; and the names of the CP dims."""
    d = layout.dims
    if layout.context.method is CPMethod.HYBRID:
        names: tuple[str, ...] = ("cp_ring", "cp_ulysses")
        shape: tuple[int, ...] = (d.cp // d.ulysses_degree, d.ulysses_degree)
    else:
        names, shape = ("cp",), (d.cp,)
    mesh = init_device_mesh("cpu", (d.pp, d.dp_replicate, d.dp_shard, *shape, d.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", *names, "tp"))
    return mesh, names

