"""``Module``: a framework module built from a Config that can shard itself.

``parallelize(mesh)`` turns the parameters named in ``sharding_config.state_shardings`` into
DTensors, wraps ``forward`` so its inputs and outputs are resharded as declared, and recurses into
child Modules.  Framework specifics come from the platform layer (``Module`` is the framework's
module class: ``torch.nn.Module`` or ``mindspore.nn.Cell``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from hp_dtensor import DeviceMesh
from hp_dtensor.platform import current as _current
from hp_protocols.configurable import Configurable
from hp_protocols.sharding import NamedPlacement, ShardingConfig, resolve_placements

_plat = _current()


class Module(_plat.Module, Configurable):  # type: ignore[misc, name-defined]
    """A protocol module: ``Module.Config(...).build()`` constructs it."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        sharding_config: ShardingConfig | None = None
        init_std: float = 0.02

    def __init__(self, config: Module.Config | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config if config is not None else type(self).Config()
        self.sharding_config: ShardingConfig | None = self.config.sharding_config
        self._parallelized = False
        self._pos_arg_names: tuple[str, ...] | None = None

    # ----- state initialization -----
    def init_states(self, *, buffer_device: Any = None) -> None:
        """Initialize every parameter and buffer of the tree (each Module its own)."""
        for sub in self.modules():
            if isinstance(sub, Module):
                sub._init_self_parameters()
                sub._init_self_buffers(buffer_device)
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()

    def _init_self_parameters(self) -> None:
        for name, param in _plat.direct_params(self):
            if param is not None:
                self._init_param(name, param)

    def _init_self_buffers(self, buffer_device: Any = None) -> None:
        """Recreate buffers that are computed, not learned (rotary tables...): subclasses override."""

    def _init_param(self, name: str, param: Any) -> None:
        """Default: matrices ~ N(0, init_std); 1-D ``bias`` zeros, other 1-D (norm scales) ones."""
        if param.ndim >= 2:
            _plat.init_param_(param, "normal", self.config.init_std)
        elif name.endswith("bias"):
            _plat.init_param_(param, "zeros")
        else:
            _plat.init_param_(param, "ones")

    def _cache_pos_arg_names(self) -> tuple[str, ...]:
        """Names of forward's positional parameters, read once from its signature."""
        if self._pos_arg_names is None:
            sig = inspect.signature(self.forward)
            self._pos_arg_names = tuple(
                p.name for p in sig.parameters.values()
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            )
        return self._pos_arg_names

    # ----- sharding -----
    def parallelize(self, mesh: DeviceMesh) -> Module:
        """Shard as declared by ``sharding_config`` (once), then recurse into child Modules."""
        sc = self.sharding_config
        if sc is not None:
            if sc.local_map is not None:
                raise NotImplementedError("local_map will be added in M9")
            if self._parallelized:
                raise RuntimeError(f"{type(self).__name__}.parallelize() was already applied")
            self._parallelized = True
            for path, named in sc.state_shardings.items():
                self._shard_state(path, named, mesh)
            # Undeclared parameters of a sharded module are replicated, so its forward sees only
            # DTensors (as distribute_module does).
            for name, param in _plat.direct_params(self):
                if param is not None and not isinstance(param, _plat.DTensor):
                    self._shard_state(name, {}, mesh)
            if sc.in_src_shardings or sc.in_dst_shardings or sc.out_src_shardings or sc.out_dst_shardings:
                self._wrap_forward_with_reshard(mesh)
        for child in self.children():
            if isinstance(child, Module):
                child.parallelize(mesh)
            else:
                _parallelize_descendants(child, mesh)
        return self

    def _shard_state(self, path: str, named: NamedPlacement, mesh: DeviceMesh) -> None:
        owner_path, _, leaf = path.rpartition(".")
        owner = self.get_submodule(owner_path) if owner_path else self
        params = dict(_plat.direct_params(owner))
        buffers = dict(_plat.direct_buffers(owner))
        placements = resolve_placements(named, mesh.mesh_dim_names)
        if leaf in params and params[leaf] is not None:
            value = params[leaf]
            local = _plat.distribute_tensor(value.data, mesh, placements, src_data_rank=_src(value))
            _plat.set_param(owner, leaf, local)
        elif leaf in buffers and buffers[leaf] is not None:
            value = buffers[leaf]
            _plat.set_buffer(owner, leaf, _plat.distribute_tensor(value, mesh, placements, src_data_rank=_src(value)))
        else:
            raise ValueError(
                f"{type(self).__name__}: state_shardings names {path!r} but it has no such parameter or buffer"
            )

    def _wrap_forward_with_reshard(self, mesh: DeviceMesh) -> None:
        names = self._cache_pos_arg_names()
        inner: Any = getattr(self, "forward")  # noqa: B009  (mypy cannot type nn.Module.forward here)
        sc = self.sharding_config
        assert sc is not None

        def forward(*args: Any, **kwargs: Any) -> Any:
            args = tuple(
                self._shard_inputs(names[i] if i < len(names) else str(i), a, mesh) for i, a in enumerate(args)
            )
            kwargs = {k: self._shard_inputs(k, v, mesh) for k, v in kwargs.items()}
            return self._shard_outputs(inner(*args, **kwargs), mesh)

        self.forward = forward  # type: ignore[method-assign]

    def _shard_inputs(self, name: str, value: Any, mesh: DeviceMesh) -> Any:
        sc = self.sharding_config
        assert sc is not None
        src, dst = sc.in_src_shardings.get(name), sc.in_dst_shardings.get(name)
        return _reshard(value, src, dst, mesh)

    def _shard_outputs(self, outputs: Any, mesh: DeviceMesh) -> Any:
        sc = self.sharding_config
        assert sc is not None
        if isinstance(outputs, tuple):
            return tuple(
                _reshard(o, sc.out_src_shardings.get(f"output{i}"), sc.out_dst_shardings.get(f"output{i}"), mesh)
                for i, o in enumerate(outputs)
            )
        return _reshard(outputs, sc.out_src_shardings.get("output"), sc.out_dst_shardings.get("output"), mesh)

    # ----- adoption of existing modules -----
    @classmethod
    def from_nn_module(cls, module: Any, config: Module.Config | None = None) -> Module:
        """Adopt an existing framework module: same parameter objects and names, its forward,
        and ``config`` (shared, not copied) as the protocol config."""
        return _Adopted(module, config if config is not None else cls.Config())


def _src(value: Any) -> int | None:
    return None if getattr(value, "is_meta", False) else 0


def _parallelize_descendants(module: Any, mesh: DeviceMesh) -> None:
    for child in module.children():
        if isinstance(child, Module):
            child.parallelize(mesh)
        else:
            _parallelize_descendants(child, mesh)


def _reshard(value: Any, src: NamedPlacement | None, dst: NamedPlacement | None, mesh: DeviceMesh) -> Any:
    if src is None and dst is None:
        return value
    names = mesh.mesh_dim_names
    if not isinstance(value, _plat.DTensor):
        if not _plat.is_tensor(value):
            return value
        value = _plat.DTensor.from_local(value, mesh, resolve_placements(src or dst or {}, names))
    elif src is not None:
        want = tuple(resolve_placements(src, names))
        if value.placements != want:
            value = value.redistribute(mesh, want)
    if dst is not None:
        target = tuple(resolve_placements(dst, names))
        if value.placements != target:
            value = value.redistribute(mesh, target)
    return value


class _Adopted(Module):
    """A framework module adopted as a protocol Module (see ``Module.from_nn_module``)."""

    def __init__(self, module: Any, config: Module.Config) -> None:
        super().__init__(config)
        # Take over the module's state under the same names, so state dicts are unchanged.
        for name, p in _plat.direct_params(module):
            self.register_parameter(name, p)
        for name, b in _plat.direct_buffers(module):
            self.register_buffer(name, b)
        for name, child in _plat.named_children(module):
            self.add_module(name, child)
        self._adopted_forward = type(module).forward
        self.adopted_type = type(module)
        for attr, value in vars(module).items():
            if not attr.startswith("_") and attr not in vars(self):
                setattr(self, attr, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._adopted_forward(self, *args, **kwargs)


class ModuleList(Module, _plat.ModuleList):  # type: ignore[misc, name-defined]
    """``ModuleList`` that is also a protocol Module."""

    def __init__(self, modules: Any = None, config: Module.Config | None = None) -> None:
        Module.__init__(self, config)
        if modules is not None:
            self.extend(modules)


class ModuleDict(Module, _plat.ModuleDict):  # type: ignore[misc, name-defined]
    """``ModuleDict`` that is also a protocol Module."""

    def __init__(self, modules: Any = None, config: Module.Config | None = None) -> None:
        Module.__init__(self, config)
        if modules is not None:
            self.update(modules)


class Sequential(Module, _plat.Sequential):  # type: ignore[misc, name-defined]
    """``Sequential`` that is also a protocol Module."""

    def __init__(self, *modules: Any, config: Module.Config | None = None) -> None:
        Module.__init__(self, config)
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def forward(self, x: Any) -> Any:
        for m in self:
            x = m(x)
        return x
