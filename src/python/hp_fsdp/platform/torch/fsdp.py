"""The primitives ``fully_shard`` needs from torch: flat communication buffers, parameter storage
that can be freed and refilled under autograd, and backward hooks.

Geometry and policy (which rows each rank owns, when to gather, what to divide by) live in
``hp_fsdp``; this file only moves bytes.  A parameter's rows are split ``torch.chunk``-style over
``n`` ranks: each rank contributes ``chunk_rows`` rows (zero-padded past the end of the tensor) so
every collective buffer has the same size on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from hp_dtensor.comm_debug import record
from hp_dtensor.layout.dtensor_spec import DTensorSpec
from hp_dtensor.platform.torch import collectives
from hp_dtensor.platform.torch.dtensor import DTensor


def _row_numel(t: torch.Tensor) -> int:
    """Elements per row of dim 0."""
    return math.prod(t.shape[1:]) if t.ndim > 1 else 1


class _Pending:
    """A collective started on the process group's worker threads; ``wait()`` returns its output."""

    def __init__(self, work: Any, out: torch.Tensor) -> None:
        self._work = work
        self._out = out

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out


class _TorchFSDP:
    """``FSDPPrimitives`` of torch."""

    # Unsharded parameters are leaves refilled in place; hooks drive the reduction.
    autograd_gather = False

    # ----- tensors and parameters -----
    @staticmethod
    def is_dtensor(t: Any) -> bool:
        return isinstance(t, DTensor)

    @staticmethod
    def local_of(t: Any) -> torch.Tensor:
        """The local data of a DTensor (or ``t`` itself), outside autograd."""
        return t._local_tensor if isinstance(t, DTensor) else t.detach()

    # Parameters and their storage outlive the call that makes them, and the first forward (which
    # allocates the unsharded parameters) may run under inference mode: they are always made as
    # normal tensors, which keep the version counter autograd and in-place refills rely on.
    @staticmethod
    def wrap(local: torch.Tensor, mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> DTensor:
        """A DTensor over ``local`` with no autograd history (parameters and gradients)."""
        with torch.inference_mode(False):
            return DTensor(local, DTensorSpec(mesh, placements, shape))

    @staticmethod
    def new_param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        with torch.inference_mode(False):
            return nn.Parameter(t, requires_grad=requires_grad)

    @staticmethod
    def shape_of(t: Any) -> tuple[int, ...]:
        return tuple(t.shape)

    @staticmethod
    def dtype_of(t: Any) -> torch.dtype:
        return t.dtype

    @staticmethod
    def device_of(t: Any) -> torch.device:
        return t.device

    @staticmethod
    def rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """An owned contiguous copy of rows ``[start, start+length)`` of ``t`` (dim 0)."""
        return t.detach().narrow(0, start, length).clone().contiguous()

    @staticmethod
    def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage of an unsharded parameter (a normal tensor, even under inference mode)."""
        with torch.inference_mode(False):
            return torch.empty(tuple(shape), dtype=dtype, device=device)

    @staticmethod
    def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    @staticmethod
    def add_(dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.add_(src)

    @staticmethod
    def get_grad(param: torch.Tensor) -> torch.Tensor | None:
        return param.grad

    @staticmethod
    def set_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
        param.grad = grad

    @staticmethod
    def to_device(t: torch.Tensor, device: Any, *, pin: bool = False) -> torch.Tensor:
        out = t.to(device, non_blocking=False)
        return out.pin_memory() if pin and out.device.type == "cpu" and torch.cuda.is_available() else out

    # ----- storage that can be freed while autograd holds the tensor -----
    @staticmethod
    def free_storage(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    @staticmethod
    def alloc_storage(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        need = t.numel() * t.element_size()
        if storage.size() != need:
            storage.resize_(need)

    # ----- flat buffers for one collective per group -----
    @staticmethod
    def gather_copy_in(shards: Sequence[torch.Tensor], chunk_rows: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """This rank's contribution: each shard cast and copied into its ``chunk_rows`` rows of one
        buffer, the rows past its end zeroed."""
        widths = [rows * _row_numel(s) for s, rows in zip(shards, chunk_rows)]
        out = torch.empty(sum(widths), dtype=dtype, device=shards[0].device)
        offset = 0
        for shard, width in zip(shards, widths):
            n = shard.numel()
            out[offset : offset + n].copy_(shard.reshape(-1))
            out[offset + n : offset + width].zero_()
            offset += width
        return out

    @staticmethod
    def gather_copy_out(
        gathered: torch.Tensor, n: int, chunk_rows: Sequence[int], dsts: Sequence[torch.Tensor]
    ) -> None:
        """Write each parameter's rows from every rank's contribution into ``dsts`` (the unsharded
        tensors, whose storage may be referenced by autograd: their version counters are kept)."""
        per_rank = gathered.view(n, -1)
        offset = 0
        for dst, rows in zip(dsts, chunk_rows):
            row_numel = _row_numel(dst)
            width = rows * row_numel
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
                if dst.shape[0] == n * rows:  # even: one strided copy straight into place
                    dst.view(n, width).copy_(per_rank[:, offset : offset + width])
                else:  # uneven: each rank's real rows (the last ranks' padding is skipped)
                    flat = dst.view(-1)
                    for r in range(n):
                        length = max(0, min(rows, dst.shape[0] - r * rows))
                        if length:
                            flat[r * width : r * width + length * row_numel].copy_(
                                per_rank[r, offset : offset + length * row_numel]
                            )
            offset += width

    @staticmethod
    def scatter_copy_in(
        grads: Sequence[torch.Tensor], n: int, chunk_rows: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Rank-major flat input of a reduce_scatter: for rank r, every parameter's rows of chunk r
        (cast; rows past a parameter's end zeroed)."""
        widths = [rows * _row_numel(g) for g, rows in zip(grads, chunk_rows)]
        out = torch.empty((n, sum(widths)), dtype=dtype, device=grads[0].device)
        offset = 0
        for g, rows, width in zip(grads, chunk_rows, widths):
            g = g.detach()
            if g.shape[0] == n * rows:  # even: one strided copy
                out[:, offset : offset + width].copy_(g.reshape(n, width))
            else:
                flat, row_numel = g.reshape(-1), width // rows if rows else 0
                for r in range(n):
                    valid = max(0, min(rows, g.shape[0] - r * rows)) * row_numel
                    out[r, offset : offset + valid].copy_(flat[r * width : r * width + valid])
                    out[r, offset + valid : offset + width].zero_()
            offset += width
        return out.reshape(-1)

    @staticmethod
    def scatter_copy_out(
        flat: torch.Tensor, chunk_rows: Sequence[int], shard_shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[torch.dtype], scale: float,
    ) -> list[torch.Tensor]:
        """This rank's gradient shards from the reduce_scatter output (padding rows dropped),
        multiplied by ``scale`` and cast to each parameter's dtype."""
        out = []
        offset = 0
        for rows, shape, dtype in zip(chunk_rows, shard_shapes, dtypes):
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            width = rows * row_numel
            piece = flat[offset : offset + shape[0] * row_numel].view(shape)
            grad = piece * scale if scale != 1.0 else piece.clone()
            out.append(grad.to(dtype))
            offset += width
        return out

    # ----- collectives on flat buffers -----
    # Issued here, not through the DTensor's collectives: the bucketed gathers overlap with
    # compute, so they are asynchronous, which the plan walker's steps are not.  Counted for
    # ``CommDebugMode`` like every other collective.
    @staticmethod
    def all_gather_start(flat: torch.Tensor, group: Any, n: int, *, async_op: bool) -> _Pending:
        """Start (or run) the all_gather of every rank's 1-D ``flat`` into one ``n * len`` buffer."""
        if n == 1:
            return _Pending(None, flat)
        out = flat.new_empty((n * flat.numel(),))
        record("all_gather", out.numel() * out.element_size(), n)
        work = dist.all_gather_single(out, flat, group=group, async_op=async_op)
        return _Pending(work if async_op else None, out)

    @staticmethod
    def reduce_scatter_start(flat: torch.Tensor, group: Any, n: int) -> _Pending:
        """Start the sum reduce_scatter of 1-D ``flat`` (rank-major, ``n`` equal parts); ``wait()``
        returns this rank's part."""
        if n == 1:
            return _Pending(None, flat)
        out = flat.new_empty((flat.numel() // n,))
        record("reduce_scatter", flat.numel() * flat.element_size(), n)
        return _Pending(dist.reduce_scatter_single(out, flat, group=group, async_op=True), out)

    @staticmethod
    def all_reduce_sum(flat: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        if n == 1:
            return flat
        return collectives.all_reduce(flat, "sum", group, n)

    # ----- autograd -----
    @staticmethod
    def grad_enabled() -> bool:
        return torch.is_grad_enabled()

    @staticmethod
    def register_post_accumulate_grad_hook(param: torch.Tensor, fn: Callable[[], None]) -> Any:
        return param.register_post_accumulate_grad_hook(lambda _p: fn())

    @staticmethod
    def register_pre_backward_hook(outputs: Any, fn: Callable[[], None]) -> bool:
        """Call ``fn`` once, when the first gradient reaches any tensor of ``outputs`` that needs
        one; False when no output needs a gradient (nothing registered)."""
        leaves, _ = tree_flatten(outputs)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return False
        register_multi_grad_hook(tensors, lambda _grads: fn(), mode="any")
        return True

    @staticmethod
    def queue_end_of_backward(fn: Callable[[], None]) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(fn)

    @staticmethod
    def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
        """Every floating-point tensor in ``tree`` cast to ``dtype`` (others untouched)."""
        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x
        return tree_map(cast, tree)

    @staticmethod
    def name_param(param: torch.Tensor, like: torch.Tensor) -> None:
        """torch names parameters by their module path: nothing to carry over."""

    @staticmethod
    def gather_in_autograd(
        sharded: Sequence[torch.Tensor], gathered: torch.Tensor, n: int, chunk_rows: Sequence[int],
        shapes: Sequence[tuple[int, ...]], backward: Callable[[list[torch.Tensor | None]], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        raise NotImplementedError("torch's fully_shard gathers into leaf parameters (autograd_gather is False)")

    @staticmethod
    def bind_value(owner: object, name: str, value: torch.Tensor | None) -> None:
        raise NotImplementedError("torch's fully_shard swaps parameters (autograd_gather is False)")


FSDP = _TorchFSDP()

__all__ = ["FSDP"]
