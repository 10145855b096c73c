"""The seven tensor-parallel styles (docs/tensor-parallel.md): how one submodule is split and what layouts
its inputs and outputs have.

Styles issue no collective themselves: parameters are split by ``distribute_tensor`` and
activations change layout through ``DTensor.redistribute`` inside forward (pre-)hooks.  Framework
specifics (module types, hooks) come from the platform layer, so the same styles serve PyTorch
and MindSpore.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from hp_dtensor import DeviceMesh, Placement, Replicate, Shard, distribute_module
from hp_dtensor.platform import current as _platform
from hp_tp import local_forward, tied
from hp_tp.platform import local_layers

Layouts = Placement | Sequence[Placement | None] | None


class ParallelStyle(ABC):
    """How ``apply`` turns one module into its tensor-parallel form.

    ``src_data_rank`` (written by ``parallelize_module``): 0 scatters/broadcasts parameters from
    group-rank 0; ``None`` lets every rank slice its own copy with no communication.
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        """Shard ``module`` in place (parameters, hooks) and return it (or a wrapper)."""

    def _src_for(self, tensor: Any) -> int | None:
        # A meta tensor holds no data: never ask a source rank to send it.
        return None if getattr(tensor, "is_meta", False) else self.src_data_rank


def _plat() -> Any:
    return _platform()


def _distribute_params(module: Any, mesh: DeviceMesh, style: ParallelStyle, placement_of: Mapping[str, Placement],
                       default: Placement) -> None:
    plat = _plat()
    for name, param in plat.direct_params(module):
        if param is None or isinstance(param, plat.DTensor):
            continue
        pl = placement_of.get(name, default)
        holder = f"{type(module).__name__}.{name}"
        shared = tied.already_split(param, mesh, pl, holder)
        if shared is not None:
            plat.share_param(module, name, shared)
            continue
        plat.set_param(module, name, plat.distribute_tensor(param.data, mesh, [pl], src_data_rank=style._src_for(param)))
        tied.record_split(param, dict(plat.direct_params(module))[name], mesh, pl, holder)


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, desired: Placement, shape: Any = None) -> Any:
    plat = _plat()
    if not isinstance(x, plat.DTensor):
        return _annotate(x, mesh, layout, desired, shape)
    if x.placements != (desired,):
        x = x.redistribute(mesh, [desired])
    return x


# the DTensors plain inputs were annotated as (one input feeding q/k/v or gate/up is gathered once)
_last_annotated = local_forward.LastInput()


def _annotate(x: Any, mesh: DeviceMesh, layout: Placement, desired: Placement, shape: Any = None) -> Any:
    plat = _plat()
    k = local_layers()
    key: tuple[Any, ...] = ()
    version = None if k is None else k.version(x)
    if k is not None and version is not None:
        # an input without a version counter (made under inference mode) is never cached: an
        # in-place change to it could not be seen
        key = (mesh, layout, desired, version, k.grad_enabled(), k.inference_mode(), x.requires_grad, shape)
        cached = _last_annotated.get(x, key)
        if cached is not None:
            return cached
    dt = plat.DTensor.from_local(x, mesh, [layout], run_check=False, shape=shape)
    if dt.placements != (desired,):
        dt = dt.redistribute(mesh, [desired])
    if version is not None:
        _last_annotated.put(x, key, dt)
    return dt


def _prepare_first_input(layout: Placement, desired: Placement, module: Any, inputs: tuple[Any, ...],
                         mesh: DeviceMesh, enter: local_forward.Enter | None = None) -> tuple[Any, ...]:
    # Only the first positional input is converted, as in torch's styles; a tuple is returned because
    # MindSpore pre-hooks must return one.
    if not inputs:
        return inputs
    if enter is not None:
        local = enter(inputs[0])  # the local path: no DTensor, the same collectives
        if local is not None:
            return (local, *inputs[1:])
    return (_to_dtensor(inputs[0], mesh, layout, desired, _input_shape(module, inputs[0], layout)), *inputs[1:])


def _input_shape(module: Any, x: Any, layout: Placement) -> tuple[int, ...] | None:
    """The global shape of a plain input sharded on its last dim into a Linear: the last dim is
    the weight's in_features, which need not divide by the mesh (a Colwise layer with uneven
    out_features feeds a Rowwise one); without it each rank would assume even shards and derive
    a different global shape."""
    plat = _plat()
    if isinstance(x, plat.DTensor) or not isinstance(layout, Shard) or not plat.is_linear_module(module):
        return None
    ndim = len(x.shape)
    if ndim == 0 or layout.dim % ndim != ndim - 1:
        return None
    return tuple(x.shape[:-1]) + (module.weight.shape[1],)


def _finish_output(layout: Placement, use_local_output: bool, reduce_dtype: Any, module: Any, outputs: Any,
                   mesh: DeviceMesh) -> Any:
    if type(outputs) is local_forward.LocalIO:  # a Colwise layer's local path: already the local output
        return outputs.value
    if outputs.placements != (layout,):
        if reduce_dtype is not None and any(p.is_partial() for p in outputs.placements):
            # Reduce partial sums in higher precision; the output keeps reduce_dtype.
            outputs = outputs.to(reduce_dtype)
        outputs = outputs.redistribute(mesh, [layout])
    return outputs.to_local() if use_local_output else outputs


def _single(layouts: Layouts, default: Placement, what: str) -> Placement:
    if layouts is None:
        return default
    if isinstance(layouts, Placement):
        return layouts
    items = list(layouts)
    if len(items) != 1 or not isinstance(items[0], Placement):
        raise ValueError(f"{what} takes one Placement, got {layouts!r}")
    return items[0]


class ColwiseParallel(ParallelStyle):
    """Split Linear ``weight``/``bias`` on dim 0 (out features) or Embedding ``weight`` on dim 1.

    Input is annotated with ``input_layouts`` (default Replicate) and gathered to Replicate; the
    output is ``Shard(-1)``, redistributed to ``output_layouts`` and returned local unless
    ``use_local_output=False``.
    """

    def __init__(self, *, input_layouts: Layouts = None, output_layouts: Layouts = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (_single(input_layouts, Replicate(), "input_layouts"),)
        self.output_layouts = (_single(output_layouts, Shard(-1), "output_layouts"),)
        self.desired_input_layouts: tuple[Placement, ...] = (Replicate(),)
        self.use_local_output = use_local_output

    def _partition(self, name: str, module: Any, mesh: DeviceMesh) -> None:
        plat = _plat()
        if plat.is_linear_module(module):
            _distribute_params(module, mesh, self, {}, Shard(0))
        elif plat.is_embedding_module(module):
            _distribute_params(module, mesh, self, {}, Shard(1))

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        plat = _plat()
        if not (plat.is_linear_module(module) or plat.is_embedding_module(module)):
            raise NotImplementedError(
                f"ColwiseParallel currently only supports Linear and Embedding modules, got {type(module).__name__}"
            )
        local_io = (device_mesh.ndim == 1 and self.input_layouts[0] == Replicate()
                    and self.output_layouts[0] == Shard(-1) and self.use_local_output)
        enter = local_forward.install_colwise(module, device_mesh, local_io=local_io)
        distribute_module(
            module,
            device_mesh,
            lambda n, m, mesh: self._partition(n, m, mesh) if m is module else None,
            partial(_prepare_first_input, self.input_layouts[0], self.desired_input_layouts[0], enter=enter),
            partial(_finish_output, self.output_layouts[0], self.use_local_output, None),
        )
        return module

    def __repr__(self) -> str:
        return (f"ColwiseParallel(input_layouts={self.input_layouts[0]!r}, output_layouts={self.output_layouts[0]!r}, "
                f"use_local_output={self.use_local_output})")


class RowwiseParallel(ParallelStyle):
    """Split Linear ``weight`` on dim 1 (in features, ``bias`` replicated) or Embedding ``weight``
    on dim 0 (vocab).

    The input is annotated ``Shard(-1)`` (Replicate for Embedding); the partial output is reduced
    to ``output_layouts`` (Replicate: all_reduce, Shard(d): reduce_scatter), in ``reduce_dtype``
    when given.
    """

    def __init__(self, *, input_layouts: Layouts = None, output_layouts: Layouts = None,
                 use_local_output: bool = True, reduce_dtype: Any = None) -> None:
        super().__init__()
        self._input_layouts_given = input_layouts is not None
        self.input_layouts = (_single(input_layouts, Shard(-1), "input_layouts"),)
        self.output_layouts = (_single(output_layouts, Replicate(), "output_layouts"),)
        self.desired_input_layouts: tuple[Placement, ...] = (Shard(-1),)
        self.use_local_output = use_local_output
        self.reduce_dtype = reduce_dtype

    def _output(self, module: Any, outputs: Any, mesh: DeviceMesh) -> Any:
        plat = _plat()
        if type(outputs) is local_forward.LocalIO:  # the local path: sum the partial outputs
            return local_forward.sum_partial(outputs, mesh)
        if not isinstance(outputs, plat.DTensor):
            if plat.is_embedding_module(module):
                # A framework whose embedding returns a plain tensor on a vocab-sharded table:
                # each rank holds its rows' contribution, i.e. a partial sum.
                from hp_dtensor import Partial

                outputs = plat.DTensor.from_local(outputs, mesh, [Partial("sum")], run_check=False)
            else:
                raise TypeError(
                    f"RowwiseParallel expected {type(module).__name__} to return a DTensor, got "
                    f"{type(outputs).__name__}; its forward must compute on the sharded weight"
                )
        return _finish_output(self.output_layouts[0], self.use_local_output, self.reduce_dtype, module, outputs, mesh)

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        plat = _plat()
        if plat.is_linear_module(module):
            placement_of = {"weight": Shard(1)}
            default: Placement = Replicate()
        elif plat.is_embedding_module(module):
            placement_of, default = {}, Shard(0)
            # Token ids must be replicated: each rank looks every id up in its own vocab rows, and
            # that is also their default annotation unless the caller gave one.
            self.desired_input_layouts = (Replicate(),)
            if not self._input_layouts_given:
                self.input_layouts = (Replicate(),)
        else:
            raise NotImplementedError(
                f"RowwiseParallel currently only supports Linear and Embedding modules, got {type(module).__name__}"
            )
        local_io = (device_mesh.ndim == 1 and self.input_layouts[0] == Shard(-1)
                    and self.output_layouts[0] == Replicate() and self.use_local_output and self.reduce_dtype is None)
        enter = local_forward.install_rowwise(module, device_mesh, local_io=local_io)
        distribute_module(
            module,
            device_mesh,
            lambda n, m, mesh: _distribute_params(m, mesh, self, placement_of, default) if m is module else None,
            partial(_prepare_first_input, self.input_layouts[0], self.desired_input_layouts[0], enter=enter),
            self._output,
        )
        return module

    def __repr__(self) -> str:
        return (f"RowwiseParallel(input_layouts={self.input_layouts[0]!r}, output_layouts={self.output_layouts[0]!r}, "
                f"use_local_output={self.use_local_output}, reduce_dtype={self.reduce_dtype})")


class SequenceParallel(ParallelStyle):
    """Replicate the module's parameters and shard its activations on ``sequence_dim`` (norms,
    dropout).  The input may be a local shard (annotated ``Shard(sequence_dim)``) or a DTensor
    in any layout; the output stays a DTensor unless ``use_local_output=True``."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _prepare(self, module: Any, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        plat = _plat()
        if not inputs:
            raise ValueError("SequenceParallel expects a tensor or DTensor input, got no positional input")
        x = inputs[0]
        if isinstance(x, plat.DTensor):
            if x.placements != (Shard(self.sequence_dim),):
                x = x.redistribute(mesh, [Shard(self.sequence_dim)])
        elif plat.is_tensor(x):
            x = plat.DTensor.from_local(x, mesh, [Shard(self.sequence_dim)], run_check=False)
        else:
            raise ValueError(
                f"SequenceParallel expects a tensor or DTensor input, got {type(x).__name__}"
            )
        return (x, *inputs[1:])

    def _output(self, module: Any, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if self.use_local_output else outputs

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        # No partition_fn: distribute_module replicates every parameter.
        distribute_module(module, device_mesh, None, self._prepare, self._output)
        local_forward.install_sequence_parallel(module, device_mesh, self.sequence_dim)
        return module

    def __repr__(self) -> str:
        return f"SequenceParallel(sequence_dim={self.sequence_dim}, use_local_output={self.use_local_output})"


class NoParallel(ParallelStyle):
    """Keep the module whole (Replicate parameters) but speak DTensor at its boundary: the first
    input is annotated ``input_layout`` and redistributed to ``desired_input_layout``; the output
    goes to ``output_layout``.  For routers or norms with sequence parallel switched off."""

    def __init__(self, *, input_layout: Placement | None = None, desired_input_layout: Placement | None = None,
                 output_layout: Placement | None = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.desired_input_layout = desired_input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        distribute_module(
            module,
            device_mesh,
            None,
            partial(_prepare_first_input, self.input_layout, self.desired_input_layout),
            partial(_finish_output, self.output_layout, self.use_local_output, None),
        )
        local_forward.install_replicated_tokenwise(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return (f"NoParallel(input_layout={self.input_layout!r}, desired_input_layout={self.desired_input_layout!r}, "
                f"output_layout={self.output_layout!r}, use_local_output={self.use_local_output})")


def _as_tuple(layouts: Layouts) -> tuple[Placement | None, ...] | None:
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    return tuple(layouts)


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional and keyword) between layouts before its forward.

    ``input_layouts[i]`` annotates positional input i (``None``: pass it through untouched) and it
    is redistributed to ``desired_input_layouts[i]``; ``input_kwarg_layouts`` /
    ``desired_input_kwarg_layouts`` do the same by keyword.  ``use_local_output=True`` hands the
    module local tensors.  Parameters are not touched.
    """

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            assert self.desired_input_layouts is not None, "desired module inputs should not be None!"
            assert len(self.input_layouts) == len(self.desired_input_layouts), (
                "input_layouts and desired_input_layouts should have same length!"
            )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        if self.with_kwargs:
            assert len(self.input_kwarg_layouts) == len(self.desired_input_kwarg_layouts), (
                "input_kwarg_layouts and desired_input_kwarg_layouts should have same length!"
            )

    def _convert(self, x: Any, layout: Placement | None, desired: Placement | None, mesh: DeviceMesh) -> Any:
        plat = _plat()
        if layout is None:
            return x
        if isinstance(x, plat.DTensor):
            dt = x
        else:
            assert plat.is_tensor(x), (
                f"PrepareModuleInput expected a tensor for layout {layout!r}, got {type(x).__name__}"
            )
            dt = plat.DTensor.from_local(x, mesh, [layout], run_check=False)
        if desired is not None and dt.placements != (desired,):
            dt = dt.redistribute(mesh, [desired])
        return dt.to_local() if self.use_local_output else dt

    def _prepare_args(self, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        if self.input_layouts is None:
            return inputs
        assert self.desired_input_layouts is not None
        if len(inputs) != len(self.input_layouts):
            raise ValueError(
                f"module inputs and input_layouts should have same length: got {len(inputs)} inputs "
                f"and {len(self.input_layouts)} layouts"
            )
        return tuple(
            self._convert(x, lay, des, mesh)
            for x, lay, des in zip(inputs, self.input_layouts, self.desired_input_layouts)
        )

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        plat = _plat()
        if self.with_kwargs:
            def hook_kw(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
                new_args = self._prepare_args(args, device_mesh)
                new_kwargs = dict(kwargs)
                for key, layout in self.input_kwarg_layouts.items():
                    if key in new_kwargs:
                        new_kwargs[key] = self._convert(
                            new_kwargs[key], layout, self.desired_input_kwarg_layouts.get(key), device_mesh
                        )
                return new_args, new_kwargs

            plat.register_forward_pre_hook(module, hook_kw, with_kwargs=True)
        else:
            plat.register_forward_pre_hook(module, lambda mod, args: self._prepare_args(args, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's output(s) between layouts after its forward: ``output_layouts[i]``
    annotates output i (``None``: untouched), redistributed to ``desired_output_layouts[i]``
    (Partial outputs reduced in ``reduce_dtype`` when given)."""

    def __init__(self, *, output_layouts: Layouts, desired_output_layouts: Layouts,
                 use_local_output: bool = True, reduce_dtype: Any = None) -> None:
        super().__init__()
        self.output_layouts = _as_tuple(output_layouts) or ()
        self.desired_output_layouts = _as_tuple(desired_output_layouts) or ()
        self.use_local_output = use_local_output
        self.reduce_dtype = reduce_dtype
        assert len(self.output_layouts) == len(self.desired_output_layouts), (
            "output_layouts and desired_output_layouts should have same length!"
        )

    def _convert(self, x: Any, layout: Placement | None, desired: Placement | None, mesh: DeviceMesh) -> Any:
        plat = _plat()
        if layout is None:
            return x
        if not isinstance(x, plat.DTensor):
            assert plat.is_tensor(x), f"PrepareModuleOutput expected a tensor for layout {layout!r}, got {type(x)}"
            x = plat.DTensor.from_local(x, mesh, [layout], run_check=False)
        elif x.placements != (layout,):
            x = x.redistribute(mesh, [layout])
        if desired is not None and x.placements != (desired,):
            if self.reduce_dtype is not None and any(p.is_partial() for p in x.placements):
                x = x.to(self.reduce_dtype)
            x = x.redistribute(mesh, [desired])
        return x.to_local() if self.use_local_output else x

    def _prepare(self, outputs: Any, mesh: DeviceMesh) -> Any:
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        if len(outs) != len(self.output_layouts):
            raise ValueError(
                f"module outputs and output_layouts should have same length: got {len(outs)} outputs "
                f"and {len(self.output_layouts)} layouts"
            )
        new = tuple(
            self._convert(o, lay, des, mesh)
            for o, lay, des in zip(outs, self.output_layouts, self.desired_output_layouts)
        )
        return new[0] if single else new

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        _plat().register_forward_hook(module, lambda mod, inputs, outputs: self._prepare(outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
                f"{self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module; ``use_local_input`` is the
    input side's ``use_local_output``."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_input: bool = False, output_layouts: Layouts, desired_output_layouts: Layouts,
                 use_local_output: bool = True, reduce_dtype: Any = None) -> None:
        super().__init__()
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output, reduce_dtype=reduce_dtype,
        )

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        self.prepare_module_input.apply(module, device_mesh)
        self.prepare_module_output.apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"
