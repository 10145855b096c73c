"""Styled Linear and Embedding layers computed as hand-written tensor-parallel code.

Once a style has split a plain Linear or Embedding, its layouts are fixed: the input arrives (from
the style's pre-hook) in the desired layout and the output leaves in a known one.  The forward is
then replaced by the local computation a Megatron layer does -- the framework's own kernel on this
rank's input and weight shard -- wrapped back into a DTensor of the known layout; the style's hooks
still issue exactly the planned collectives, the parameters stay the same DTensors (their
gradients come back with the parameters' placements), and any input not in the expected layout
runs the module's own forward on DTensors as before.  Backends without local kernels keep the
DTensor forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_dtensor import DeviceMesh, Partial, Placement, Replicate, Shard
from hp_dtensor.platform import current as _platform
from hp_tp.platform import local_layers


def _kernels() -> Any:
    return local_layers()


def _dtensor_forward(module: Any) -> Callable[..., Any]:
    # The class's forward, bound: what the module ran before the local forward was installed.
    return type(module).forward.__get__(module)  # type: ignore[no-any-return]


def _local(param: Any) -> Any:
    return None if param is None else param.to_local()


def install_colwise(module: Any, mesh: DeviceMesh) -> None:
    """Linear (weight ``Shard(0)``) or Embedding (weight ``Shard(1)``): input Replicate, output
    ``Shard(-1)``; no collective inside."""
    k = _kernels()
    if k is None:
        return
    plat = _platform()
    fallback = _dtensor_forward(module)
    replicate: tuple[Placement, ...] = (Replicate(),)
    out_pl = [Shard(-1)]
    if k.is_plain_linear(module):
        def forward(x: Any) -> Any:
            if not (isinstance(x, plat.DTensor) and x.placements == replicate):
                return fallback(x)
            # Every rank uses the whole input: each rank's input gradient is a partial sum.
            xl = x.to_local(grad_placements=[Partial()])
            y = k.linear(xl, module.weight.to_local(), _local(module.bias))
            # The global shape, not local x n: out_features need not divide by the mesh.
            shape = tuple(x.shape[:-1]) + (module.weight.shape[0],)
            return plat.DTensor.from_local(y, mesh, out_pl, run_check=False, shape=shape)
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
        return
    k.set_forward(module, forward)


def install_rowwise(module: Any, mesh: DeviceMesh) -> None:
    """Linear (weight ``Shard(1)``, input ``Shard(-1)``, no bias) or Embedding (weight
    ``Shard(0)``, ids Replicate): the output is this rank's partial sum, reduced by the style."""
    k = _kernels()
    if k is None:
        return
    plat = _platform()
    fallback = _dtensor_forward(module)
    partial_pl = [Partial()]
    if k.is_plain_linear(module) and module.bias is None:
        # (with a bias the DTensor forward adds it once; that path is kept)
        def forward(x: Any) -> Any:
            if not (isinstance(x, plat.DTensor) and _sharded_last(x.placements, x.ndim)):
                return fallback(x)
            y = k.linear(x.to_local(), module.weight.to_local(), None)
            return plat.DTensor.from_local(y, mesh, partial_pl, run_check=False)
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
        return
    k.set_forward(module, forward)


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
