"""Styled Linear and Embedding layers computed as hand-written tensor-parallel code.

Once a style has split a plain Linear or Embedding, its layouts are fixed: the input arrives (from
the style's pre-hook) in the desired layout and the output leaves in a known one.  The forward is
then replaced by the local computation a Megatron layer does -- the framework's own kernel on this
rank's input and weight shard -- wrapped back into a DTensor of the known layout; the style's hooks
still issue exactly the planned collectives, the parameters stay the same DTensors (their
gradients come back with the parameters' placements), and any input not in the expected layout
runs the module's own forward on DTensors as before.  Backends without local kernels keep the
DTensor forward.

Where a layer's plan takes a plain tensor in and gives one out (a Colwise layer on a replicated
input with a local ``Shard(-1)`` output, a Rowwise one on a local shard with a replicated local
output), no DTensor is made at all while the layer has no hooks but the style's: its pre-hook
hands the forward a ``LocalIO`` (the input as is, or through the identity whose gradient is
all-reduced, shared by every Colwise layer that takes the same input), and the forward's
``LocalIO`` result leaves through the post-hook as the plain output (a Rowwise one all-reduced).
The collectives are the same, on the same values, as the DTensor path's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from hp_dtensor import DeviceMesh, Partial, Placement, Replicate, Shard
from hp_dtensor.layout.shard_geometry import chunk_size_and_offset
from hp_dtensor.platform import current as _platform
from hp_tp.platform import local_layers


def _kernels() -> Any:
    return local_layers()


def _dtensor_forward(module: Any) -> Callable[..., Any]:
    # The class's forward, bound: what the module ran before the local forward was installed.
    return type(module).forward.__get__(module)  # type: ignore[no-any-return]


def _local(param: Any) -> Any:
    return None if param is None else param.to_local()


class LocalIO:
    """A plain local tensor passed between a styled layer's own hooks and its local forward.  No
    other code sees one: the path is taken only while the layer has no hooks but the style's."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


Enter = Callable[[Any], "LocalIO | None"]
# The style's forward pre-hook and forward hook: what ``only_own_hooks`` expects to find.
_OWN_HOOKS = (1, 1)


class LastInput:
    """What was made from the last plain input of a styled layer, reused when the next layer gets
    the same tensor under the same key (q/k/v or gate/up projections of one input): the input is
    gathered once and its gradient reduced once, as in a hand-written layer.  Only the last input
    is kept, checked by identity and the key (which holds its in-place version); an input that
    cannot be weakly referenced is never cached."""

    def __init__(self) -> None:
        self.ref: Any = None
        self.key: tuple[Any, ...] = ()
        self.value: Any = None

    def get(self, x: Any, key: tuple[Any, ...]) -> Any:
        """The value made from ``x`` under ``key``, or None."""
        if self.ref is not None and self.ref() is x and self.key == key:
            return self.value
        return None

    def put(self, x: Any, key: tuple[Any, ...], value: Any) -> None:
        try:
            self.ref, self.key, self.value = weakref.ref(x), key, value
        except TypeError:
            self.ref = None


# the plain inputs ``replicate_input`` made, for the local path's Colwise layers
_last_replicated = LastInput()


def _replicated(k: Any, x: Any, mesh: DeviceMesh) -> Any:
    if not (k.grad_enabled() and k.requires_grad(x)):
        return x  # no gradient to reduce
    version = k.version(x)
    if version is None:  # no version counter (inference mode): an in-place change could not be seen
        return k.replicate_input(x, mesh)
    key = (mesh, version, k.inference_mode())
    out = _last_replicated.get(x, key)
    if out is None:
        out = k.replicate_input(x, mesh)
        _last_replicated.put(x, key, out)
    return out


def install_colwise(module: Any, mesh: DeviceMesh, *, local_io: bool = False) -> Enter | None:
    """Linear (weight ``Shard(0)``) or Embedding (weight ``Shard(1)``): input Replicate, output
    ``Shard(-1)``; no collective inside.  With ``local_io`` (the plan takes a replicated plain
    input and returns the local output), a Linear's pre-hook may call the returned ``enter`` on
    a plain input: a ``LocalIO`` for the local path, or None (DTensors as usual)."""
    k = _kernels()
    if k is None:
        return None
    plat = _platform()
    fallback = _dtensor_forward(module)
    replicate: tuple[Placement, ...] = (Replicate(),)
    out_pl = [Shard(-1)]
    enter: Enter | None = None
    if k.is_plain_linear(module):
        def forward(x: Any) -> Any:
            if type(x) is LocalIO:
                return LocalIO(k.linear(x.value, module.weight.to_local(), _local(module.bias)))
            if not (isinstance(x, plat.DTensor) and x.placements == replicate):
                return fallback(x)
            # Every rank uses the whole input: each rank's input gradient is a partial sum.
            xl = x.to_local(grad_placements=[Partial()])
            y = k.linear(xl, module.weight.to_local(), _local(module.bias))
            # The global shape, not local x n: out_features need not divide by the mesh.
            shape = tuple(x.shape[:-1]) + (module.weight.shape[0],)
            return plat.DTensor.from_local(y, mesh, out_pl, run_check=False, shape=shape)

        if local_io:
            def enter(x: Any) -> LocalIO | None:
                if not (k.is_plain_tensor(x) and k.only_own_hooks(module, *_OWN_HOOKS)):
                    return None
                return LocalIO(_replicated(k, x, mesh))
    elif k.is_plain_embedding(module):
        def forward(x: Any) -> Any:
            if not (isinstance(x, plat.DTensor) and x.placements == replicate):
                return fallback(x)
            ids = x.to_local()
            k.check_ids(ids, module.num_embeddings)
            y = k.embedding(ids, module.weight.to_local(), module.padding_idx)
            shape = tuple(x.shape) + (module.weight.shape[1],)
            return plat.DTensor.from_local(y, mesh, out_pl, run_check=False, shape=shape)
    else:
        return None
    k.set_forward(module, forward)
    return enter


def install_rowwise(module: Any, mesh: DeviceMesh, *, local_io: bool = False) -> Enter | None:
    """Linear (weight ``Shard(1)``, input ``Shard(-1)``, no bias) or Embedding (weight
    ``Shard(0)``, ids Replicate): the output is this rank's partial sum, reduced by the style.
    With ``local_io`` (the plan takes a plain local shard and returns the replicated local
    output), a Linear's pre-hook may call the returned ``enter`` on a plain input: a ``LocalIO``
    for the local path (the post-hook sums it with ``sum_partial``), or None."""
    k = _kernels()
    if k is None:
        return None
    plat = _platform()
    fallback = _dtensor_forward(module)
    partial_pl = [Partial()]
    enter: Enter | None = None
    if k.is_plain_linear(module) and module.bias is None:
        # (with a bias the DTensor forward adds it once; that path is kept)
        def forward(x: Any) -> Any:
            if type(x) is LocalIO:
                return LocalIO(k.linear(x.value, module.weight.to_local(), None))
            if not (isinstance(x, plat.DTensor) and _sharded_last(x.placements, x.ndim)):
                return fallback(x)
            y = k.linear(x.to_local(), module.weight.to_local(), None)
            return plat.DTensor.from_local(y, mesh, partial_pl, run_check=False)

        if local_io:
            # this rank's share of in_features (torch.chunk's split, as the weight's Shard(1))
            local_in, _ = chunk_size_and_offset(module.weight.shape[1], mesh.size(0), mesh.get_local_rank(0))

            def enter(x: Any) -> LocalIO | None:
                # an input whose last dim is not that share goes the DTensor way, which names it
                if not (k.is_plain_tensor(x) and len(x.shape) > 0 and x.shape[-1] == local_in
                        and k.only_own_hooks(module, *_OWN_HOOKS)):
                    return None
                return LocalIO(x)
    elif k.is_plain_embedding(module):
        replicate: tuple[Placement, ...] = (Replicate(),)

        def forward(x: Any) -> Any:
            if not (isinstance(x, plat.DTensor) and x.placements == replicate):
                return fallback(x)
            ids = x.to_local()
            k.check_ids(ids, module.num_embeddings)
            # rows split like torch.chunk: rank r holds [r * ceil(V / n), ...)
            start = mesh.get_local_rank(0) * -(-module.num_embeddings // mesh.size(0))
            y = k.vocab_slice_embedding(ids, module.weight.to_local(), start, module.padding_idx)
            return plat.DTensor.from_local(y, mesh, partial_pl, run_check=False)
    else:
        return None
    k.set_forward(module, forward)
    return enter


def sum_partial(out: LocalIO, mesh: DeviceMesh) -> Any:
    """A Rowwise layer's ``LocalIO`` output: its partial sums all-reduced, a plain tensor."""
    k = _kernels()
    assert k is not None  # a LocalIO comes only from a backend with local kernels
    return k.sum_partial_output(out.value, mesh)


def _sharded_last(placements: tuple[Placement, ...], ndim: int) -> bool:
    return len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim % ndim == ndim - 1


def install_sequence_parallel(module: Any, mesh: DeviceMesh, sequence_dim: int) -> None:
    """A token-wise module (a norm) on a sequence shard: run it on the local shard with its
    replicated parameters' local values (their gradient, from this rank's tokens only, is a
    partial sum), and return the shard as ``Shard(sequence_dim)``.  No collective."""
    k = _kernels()
    if k is None or not k.is_tokenwise_module(module):
        return
    plat = _platform()
    fallback = _dtensor_forward(module)
    reduced = k.normalized_ndim(module)  # the sharded dim must not be one the module reduces over

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(x, plat.DTensor) and len(x.placements) == 1 and isinstance(x.placements[0], Shard)
                and x.placements[0].dim % x.ndim == sequence_dim % x.ndim
                and sequence_dim % x.ndim < x.ndim - reduced):
            return fallback(x, *args, **kwargs)
        params = {
            name: p.to_local(grad_placements=[Partial()])
            for name, p in plat.direct_params(module)
            if p is not None
        }
        y = k.run_with_params(module, fallback, params, x.to_local(), *args, **kwargs)
        return plat.DTensor.from_local(y, mesh, [x.placements[0]], run_check=False, shape=tuple(x.shape))

    k.set_forward(module, forward)


def install_replicated_tokenwise(module: Any, mesh: DeviceMesh) -> None:
    """A token-wise module (a norm) kept whole on replicated activations (``NoParallel``, sequence
    parallel off): run it on the local tensor with its parameters' local values and return the
    result as ``Replicate``.  Its gradient is then made whole (all-reduced, if a later
    column-parallel layer left it partial) where it enters the module, as Megatron does, so the
    parameters' gradients come out whole; the ops run without DTensor dispatch."""
    k = _kernels()
    if k is None or not k.is_tokenwise_module(module):
        return
    plat = _platform()
    fallback = _dtensor_forward(module)
    replicate: tuple[Placement, ...] = (Replicate(),)

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(x, plat.DTensor) and x.placements == replicate):
            return fallback(x, *args, **kwargs)
        params = {name: p.to_local() for name, p in plat.direct_params(module) if p is not None}
        y = k.run_with_params(module, fallback, params, x.to_local(), *args, **kwargs)
        return plat.DTensor.from_local(y, mesh, replicate, run_check=False, shape=tuple(x.shape))

    k.set_forward(module, forward)
