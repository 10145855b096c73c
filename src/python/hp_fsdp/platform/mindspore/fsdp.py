"""The primitives ``fully_shard`` needs from MindSpore (PyNative): flat communication buffers
and one differentiable gather per group.

How it differs from torch, and why:

* Gradients.  A MindSpore parameter has no ``.grad`` and there are no per-parameter
  post-accumulate-grad hooks nor an end-of-backward callback: ``mindspore.value_and_grad(fn,
  None, weights)`` returns the gradients of ``weights``.  So the unsharded parameters are not
  leaves here (``autograd_gather``): each forward gathers a group with one all_gather and turns the
  result into the unsharded values through one ``mindspore._Function`` whose inputs are the
  group's sharded parameters; its backward *is* the group's reduction (one reduce_scatter, one
  all_reduce across replicas under HSDP, the divide), so ``value_and_grad`` over the sharded
  parameters (what the optimizer holds) returns their sharded gradients directly.  With gradient
  sync off the unsharded gradients are kept in the group and reduced with the next synced
  backward; the sharded gradients of the unsynced micro-steps are zeros.
* Showing the unsharded values.  A cell's parameter slot only takes a ``Parameter`` (assigning a
  tensor to it would ``set_data`` the sharded parameter); the gathered value is put in the cell's
  instance ``__dict__``, which attribute lookup reads before the cell's parameter table, and taken
  out again at reshard, so the sharded ``Parameter`` shows through.
* Freeing unsharded storage.  MindSpore has no storage resize: a tensor's memory is released
  when the last reference goes.  The gathered values are dropped after each forward (every
  group reshards after forward, whatever ``reshard_after_forward`` says), but the forward's graph
  keeps the ones that backward needs until that backward is over; so backward needs no second
  all_gather (one all_gather per group per step, not torch's two for groups that reshard after
  forward), and between steps each rank holds only its shards.  Between forward and backward the
  unsharded parameters are held as on one process: ``reshard_after_forward`` saves no memory here.
* TP parameters: the gathered value of a TP shard is wrapped as a DTensor with its TP placements,
  so hp_tp's styles run on it; its gradient reaches the gather as the local one.
* Not built: ``CPUOffloadPolicy`` off a CPU job (MindSpore CPU ranks only here), clipping
  (``grad_norm.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import mindspore as ms
from mindspore import Tensor, mint
from mindspore._c_expression import NoFallbackGuard

from hp_dtensor.layout.dtensor_spec import DTensorSpec
from hp_dtensor.platform.mindspore import collectives as C
from hp_dtensor.platform.mindspore.dtensor import DTensor

_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


def _row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _shape(t: Any) -> tuple[int, ...]:
    """The local shape (a DTensor's ``shape`` is the global one)."""
    return tuple(Tensor.shape.fget(t))


def _group_index(group: Any, n: int) -> int:
    """This rank's index in ``group`` (a MindSpore group name)."""
    if n == 1 or group is None:
        return 0
    from mindspore.communication import get_rank

    return int(get_rank(group))


def _as(t: Tensor, dtype: Any) -> Tensor:
    """``t`` in ``dtype``; no copy when it already is (``astype`` copies regardless)."""
    return t if t.dtype == dtype else t.astype(dtype)


def _not_here(what: str) -> NoReturn:
    raise NotImplementedError(
        f"{what} is not supported by fully_shard on the mindspore backend: MindSpore parameters hold no .grad "
        f"and tensors have no resizable storage; the gradients come from mindspore.value_and_grad over the "
        f"sharded parameters"
    )


class _Done:
    """A collective already finished (MindSpore's CPU collectives are synchronous here)."""

    def __init__(self, out: Tensor) -> None:
        self._out = out

    def wait(self) -> Tensor:
        return self._out


def _split_gathered(gathered: Tensor, n: int, chunk_rows: Sequence[int],
                    shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """Each parameter's unsharded value from the rank-major gathered buffer (padding dropped):
    one concatenation of the ranks' pieces per parameter, the only copy (a reshape of a strided
    view would copy once more)."""
    flat = gathered.reshape((-1,))
    per_rank = _shape(flat)[0] // n
    out, offset = [], 0
    for rows, shape in zip(chunk_rows, shapes):
        row = _row_numel(shape)
        width = rows * row
        if width == 0:
            out.append(mint.zeros(tuple(shape), dtype=gathered.dtype))
            continue
        pieces = [mint.narrow(flat, 0, r * per_rank + offset, width) for r in range(n)]
        joined = mint.cat(pieces, 0)
        if n * width != shape[0] * row:  # the last rank's padding
            joined = C.dense(mint.narrow(joined, 0, 0, shape[0] * row))
        out.append(joined.reshape(tuple(shape)))
        offset += width
    return out


class _GatherFn(ms._Function):  # type: ignore[misc]
    """Forward: the unsharded values (already gathered) of the group's sharded parameters, its
    inputs.  Backward: the group's reduction (``meta.backward``) of the values' gradients."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        meta = args[-1]
        ctx.meta = meta
        with NoFallbackGuard():
            values = _split_gathered(meta.gathered, meta.n, meta.chunk_rows, meta.shapes)
        meta.gathered = None  # the values hold what backward needs; the buffer can go
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        meta = ctx.meta
        with NoFallbackGuard():
            plain = [None if g is None else C._plain(g) for g in grads]
            shards = meta.backward(plain)
        return tuple(shards) + (None,)


class _GatherMeta:
    def __init__(self, gathered: Tensor, n: int, chunk_rows: Sequence[int], shapes: Sequence[tuple[int, ...]],
                 backward: Callable[[list[Any]], list[Tensor]]) -> None:
        self.gathered: Tensor | None = gathered
        self.n = n
        self.chunk_rows = list(chunk_rows)
        self.shapes = [tuple(s) for s in shapes]
        self.backward = backward


def _cast_tree(x: Any, dtype: Any) -> Any:
    """Every floating-point tensor in ``x`` (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(x, Tensor):
        return x.astype(dtype) if x.dtype in _FLOATS and x.dtype != dtype else x
    if isinstance(x, tuple):
        return tuple(_cast_tree(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast_tree(v, dtype) for v in x]
    if isinstance(x, dict):
        return {k: _cast_tree(v, dtype) for k, v in x.items()}
    return x


class _MindSporeFSDP:
    """``FSDPPrimitives`` of MindSpore."""

    autograd_gather = True

    # ----- tensors and parameters -----
    @staticmethod
    def is_dtensor(t: Any) -> bool:
        return isinstance(t, DTensor)

    @staticmethod
    def local_of(t: Any) -> Tensor:
        return C._plain(t)

    @staticmethod
    def wrap(local: Any, mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> DTensor:
        return DTensor(local, DTensorSpec(mesh, placements, shape))

    @staticmethod
    def new_param(t: Any, requires_grad: bool) -> Any:
        return ms.Parameter(t, requires_grad=requires_grad)

    @staticmethod
    def name_param(param: Any, like: Any) -> None:
        """The sharded parameter keeps the name of the one it replaces (optimizers and checkpoints
        key on it)."""
        param.name = like.name

    @staticmethod
    def shape_of(t: Any) -> tuple[int, ...]:
        return tuple(t.shape)

    @staticmethod
    def dtype_of(t: Any) -> Any:
        return t.dtype

    @staticmethod
    def device_of(t: Any) -> str:
        return "cpu"

    @staticmethod
    def rows(t: Any, start: int, length: int) -> Tensor:
        with NoFallbackGuard():
            return C.copy(C.dense(mint.narrow(C._plain(t), 0, start, length)))

    @staticmethod
    def empty(shape: Sequence[int], dtype: Any, device: Any) -> Tensor:
        return mint.zeros(tuple(shape), dtype=dtype)

    @staticmethod
    def zeros(shape: Sequence[int], dtype: Any, device: Any) -> Tensor:
        return mint.zeros(tuple(shape), dtype=dtype)

    @staticmethod
    def add_(dst: Tensor, src: Tensor) -> None:
        """In place (``Tensor.add_`` on a tensor made from host data returns a new one and leaves
        ``dst`` as it was; ``copy_`` writes through)."""
        with NoFallbackGuard():
            dst.copy_(dst + src.astype(dst.dtype))

    @staticmethod
    def get_grad(param: Any) -> NoReturn:
        _not_here("reading a parameter's .grad")

    @staticmethod
    def set_grad(param: Any, grad: Any) -> NoReturn:
        _not_here("setting a parameter's .grad")

    @staticmethod
    def to_device(t: Any, device: Any, *, pin: bool = False) -> Any:
        if str(device) != "cpu":
            raise NotImplementedError(
                f"CPUOffloadPolicy / moving shards to {device!r} is not supported by fully_shard on the mindspore "
                f"backend (its ranks run on CPU here); drop offload_policy"
            )
        return t

    @staticmethod
    def free_storage(t: Any) -> NoReturn:
        _not_here("freeing a tensor's storage in place")

    @staticmethod
    def alloc_storage(t: Any) -> NoReturn:
        _not_here("refilling a tensor's storage in place")

    # ----- flat buffers -----
    @staticmethod
    def gather_copy_in(shards: Sequence[Any], chunk_rows: Sequence[int], dtype: Any) -> Tensor:
        """This rank's contribution: each shard cast, flattened and zero-padded to ``chunk_rows`` rows."""
        pieces = []
        with NoFallbackGuard():
            for shard, rows in zip(shards, chunk_rows):
                s = C._plain(shard)
                shape = _shape(s)
                if shape[0] < rows:
                    s = C.pad(s, 0, rows)
                pieces.append(_as(s, dtype).reshape((-1,)))
            return mint.cat(pieces, 0)

    @staticmethod
    def gather_copy_out(gathered: Any, n: int, chunk_rows: Sequence[int], dsts: Sequence[Any]) -> NoReturn:
        _not_here("gathering into leaf parameters in place")

    @staticmethod
    def scatter_copy_in(grads: Sequence[Any], n: int, chunk_rows: Sequence[int], dtype: Any) -> Tensor:
        """Rank-major flat input of a reduce_scatter: for rank r, every parameter's rows of chunk r
        (cast; rows past a parameter's end zeroed)."""
        cols = []
        with NoFallbackGuard():
            for g, rows in zip(grads, chunk_rows):
                g = C._plain(g)
                shape = _shape(g)
                if shape[0] < n * rows:
                    g = C.pad(g, 0, n * rows)
                cols.append(_as(g, dtype).reshape((n, rows * _row_numel(shape))))
            return mint.cat(cols, 1).reshape((-1,))

    @staticmethod
    def scatter_copy_out(flat: Any, chunk_rows: Sequence[int], shard_shapes: Sequence[tuple[int, ...]],
                         dtypes: Sequence[Any], scale: float) -> list[Tensor]:
        """This rank's gradient shards (padding dropped), times ``scale``, in each parameter's dtype."""
        out, offset = [], 0
        with NoFallbackGuard():
            for rows, shape, dtype in zip(chunk_rows, shard_shapes, dtypes):
                numel = shape[0] * _row_numel(shape)
                piece = mint.narrow(flat, 0, offset, numel).reshape(tuple(shape))
                out.append(_as(piece * scale, dtype))
                offset += rows * _row_numel(shape)
        return out

    # ----- collectives -----
    @staticmethod
    def all_gather_start(flat: Any, group: Any, n: int, *, async_op: bool) -> _Done:
        if n == 1:
            return _Done(flat)
        with NoFallbackGuard():
            return _Done(C.all_gather(flat, 0, group, n, _group_index(group, n)))

    @staticmethod
    def reduce_scatter_start(flat: Any, group: Any, n: int) -> _Done:
        if n == 1:
            return _Done(flat)
        with NoFallbackGuard():
            return _Done(C.reduce_scatter(flat, 0, "sum", group, n, _group_index(group, n)))

    @staticmethod
    def all_reduce_sum(flat: Any, group: Any, n: int) -> Tensor:
        if n == 1:
            return flat
        with NoFallbackGuard():
            return C.all_reduce(flat, "sum", group, n, _group_index(group, n))

    # ----- autograd -----
    @staticmethod
    def grad_enabled() -> bool:
        """MindSpore has no global grad mode in PyNative: a forward may always be differentiated."""
        return True

    @staticmethod
    def register_post_accumulate_grad_hook(param: Any, fn: Callable[[], None]) -> NoReturn:
        _not_here("a post-accumulate-grad hook")

    @staticmethod
    def register_pre_backward_hook(outputs: Any, fn: Callable[[], None]) -> bool:
        """Backward needs nothing gathered (the forward's graph keeps the values): no hook."""
        return False

    @staticmethod
    def queue_end_of_backward(fn: Callable[[], None]) -> NoReturn:
        _not_here("an end-of-backward callback")

    @staticmethod
    def cast_floating(tree: Any, dtype: Any) -> Any:
        return _cast_tree(tree, dtype)

    @staticmethod
    def gather_in_autograd(sharded: Sequence[Any], gathered: Any, n: int, chunk_rows: Sequence[int],
                           shapes: Sequence[tuple[int, ...]],
                           backward: Callable[[list[Any]], list[Tensor]]) -> list[Tensor]:
        meta = _GatherMeta(gathered, n, chunk_rows, shapes, backward)
        out = _GatherFn.apply(*sharded, meta)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    @staticmethod
    def bind_value(owner: object, name: str, value: Any) -> None:
        """Show ``value`` as ``owner.<name>`` (None: the cell's own parameter again)."""
        if value is None:
            owner.__dict__.pop(name, None)
        else:
            object.__setattr__(owner, name, value)


FSDP = _MindSporeFSDP()

__all__ = ["FSDP"]
