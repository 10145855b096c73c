"""``Module``: a framework module built from a Config that can shard itself.

``parallelize(mesh)`` turns the parameters named in ``sharding_config.state_shardings`` into
DTensors, wraps the module's call (``forward`` on torch, ``construct`` on MindSpore) so its inputs
and outputs are resharded as declared, and recurses into child Modules.  Framework specifics come
from the platform layer only (``Module`` is the framework's module class: ``torch.nn.Module`` or
``mindspore.nn.Cell``), so the same protocol code and the same errors hold on both frameworks.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from hp_dtensor import DeviceMesh
from hp_dtensor.placement_types import Shard
from hp_dtensor.platform import current as _current
from hp_protocols.configurable import Configurable
from hp_protocols.sharding import NamedPlacement, ShardingConfig, resolve_placements

_plat = _current()
# The method a module's call runs: "forward" (torch) or "construct" (MindSpore).
FORWARD: str = _plat.FORWARD
_OUTPUT_NAME = re.compile(r"^output(\d+)?$")


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
        for _, sub in _plat.named_modules(self):
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
        """Names of the call's positional parameters, read once from its signature."""
        if self._pos_arg_names is None:
            sig = inspect.signature(getattr(self, FORWARD))
            self._pos_arg_names = tuple(
                p.name for p in sig.parameters.values()
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            )
        return self._pos_arg_names

    # ----- sharding -----
    def parallelize(self, mesh: DeviceMesh) -> Module:
        """Shard the tree as declared by each Module's ``sharding_config`` (once per Module).

        Fails closed: every declaration of the tree is checked first (``NotImplementedError`` for
        ``local_map``, ``RuntimeError`` for a Module already parallelized, ``ValueError`` for a
        path, axis, shard dim or argument name that does not exist, ``TypeError`` for a mesh that
        is not a DeviceMesh), then every new DTensor is made, and only then is anything assigned,
        so a call that raises leaves the tree exactly as it was."""
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{type(self).__name__}.parallelize() needs a DeviceMesh, got {type(mesh).__name__}")
        claimed: set[tuple[int, str]] = set()
        plans = [_plan_module(m, mesh, claimed) for m in _sharded_modules(self)]
        made = [
            [(owner, leaf, is_param, _plat.distribute_tensor(
                value.data if is_param else value, mesh, placements, src_data_rank=_src(value)))
             for owner, leaf, is_param, value, placements in plan]
            for _, plan in plans
        ]
        for (module, _), states in zip(plans, made):
            for owner, leaf, is_param, dt in states:
                (_plat.set_param if is_param else _plat.set_buffer)(owner, leaf, dt)
            module._parallelized = True
            sc = module.sharding_config
            assert sc is not None
            if sc.in_src_shardings or sc.in_dst_shardings or sc.out_src_shardings or sc.out_dst_shardings:
                module._wrap_forward_with_reshard(mesh)
        return self

    def _wrap_forward_with_reshard(self, mesh: DeviceMesh) -> None:
        names = self._cache_pos_arg_names()
        inner: Any = getattr(self, FORWARD)

        def forward(*args: Any, **kwargs: Any) -> Any:
            args = tuple(
                self._shard_inputs(names[i] if i < len(names) else str(i), a, mesh) for i, a in enumerate(args)
            )
            kwargs = {k: self._shard_inputs(k, v, mesh) for k, v in kwargs.items()}
            return self._shard_outputs(inner(*args, **kwargs), mesh)

        setattr(self, FORWARD, forward)

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
        """Adopt an existing framework module: same parameter objects and names, its call
        (``forward`` / ``construct``), and ``config`` (shared, not copied) as the protocol config."""
        if not _plat.is_module(module):
            raise TypeError(f"from_nn_module expects a framework module, got {type(module).__name__}")
        return _Adopted(module, config if config is not None else cls.Config())


def children_of(module: Any) -> list[Any]:
    """Direct child modules, in registration order."""
    return [c for _, c in _plat.named_children(module)]


def submodule(root: Any, path: str) -> Any:
    """The descendant at dotted ``path`` ("" is ``root``); ``ValueError`` naming the path if absent."""
    module = root
    for part in path.split(".") if path else ():
        found = dict(_plat.named_children(module)).get(part)
        if found is None:
            raise ValueError(f"{type(root).__name__} has no submodule {path!r} (no child {part!r})")
        module = found
    return module


def _sharded_modules(root: Module) -> list[Module]:
    """Every Module of the tree with a sharding_config, in parallelize order (a Module before its
    children; through non-protocol containers)."""
    out: list[Module] = []

    def visit(m: Any) -> None:
        if isinstance(m, Module) and m.sharding_config is not None:
            out.append(m)
        for child in children_of(m):
            visit(child)

    visit(root)
    return out


_StatePlan = list[tuple[Any, str, bool, Any, list[Any]]]


def _plan_module(module: Module, mesh: DeviceMesh, claimed: set[tuple[int, str]]) -> tuple[Module, _StatePlan]:
    """Check ``module``'s declaration against itself and ``mesh``; return (owner, leaf, is_param,
    value, placements) for every state that becomes a DTensor.  Reads only, changes nothing but
    ``claimed`` (the states earlier Modules of the tree already placed: a parent may place a
    child's parameter by path, and then the child's default does not apply)."""
    sc = module.sharding_config
    what = type(module).__name__
    assert sc is not None
    if sc.local_map is not None:
        raise NotImplementedError("local_map will be added in M9")
    if module._parallelized:
        raise RuntimeError(f"{what}.parallelize() was already applied")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{what}.parallelize() needs a mesh with mesh_dim_names (e.g. ('tp',)), got {mesh}")
    plan: _StatePlan = []
    for path, named in sc.state_shardings.items():
        owner_path, _, leaf = path.rpartition(".")
        try:
            owner = submodule(module, owner_path)
        except ValueError:
            raise ValueError(f"{what}: state_shardings names {path!r} but it has no such parameter or buffer") from None
        params, buffers = dict(_plat.direct_params(owner)), dict(_plat.direct_buffers(owner))
        is_param = params.get(leaf) is not None
        value = params[leaf] if is_param else buffers.get(leaf)
        if value is None:
            raise ValueError(f"{what}: state_shardings names {path!r} but it has no such parameter or buffer")
        if isinstance(value, _plat.DTensor):
            raise RuntimeError(f"{what}: {path!r} is already a DTensor (parallelized by another plan?)")
        placements = _checked(what, f"state_shardings[{path!r}]", named, names)
        ndim = len(value.shape)
        for p in placements:
            if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"{what}: state_shardings[{path!r}] shards dim {p.dim} but {path} has {ndim} dim(s) "
                    f"(shape {tuple(value.shape)})"
                )
        key = (id(owner), leaf)
        if key in claimed:
            raise ValueError(f"{what}: state_shardings[{path!r}] places a state another declaration already placed")
        claimed.add(key)
        plan.append((owner, leaf, is_param, value, placements))
    # Undeclared parameters of a sharded module are replicated, so its call sees only DTensors
    # (as distribute_module does).
    for name, param in _plat.direct_params(module):
        if param is not None and (id(module), name) not in claimed and not isinstance(param, _plat.DTensor):
            claimed.add((id(module), name))
            plan.append((module, name, True, param, resolve_placements({}, names)))
    _check_io(module, what, sc, names)
    return module, plan


def _checked(what: str, where: str, named: NamedPlacement, names: Any) -> list[Any]:
    try:
        return resolve_placements(named, names)
    except ValueError as e:
        raise ValueError(f"{what}: {where}: {e}") from None


def _check_io(module: Module, what: str, sc: ShardingConfig, names: Any) -> None:
    sig = inspect.signature(getattr(module, FORWARD))
    params = sig.parameters.values()
    takes_any = any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in params)
    arg_names = {p.name for p in params}
    for field_name in ("in_src_shardings", "in_dst_shardings"):
        for arg, named in getattr(sc, field_name).items():
            if not takes_any and arg not in arg_names:
                raise ValueError(
                    f"{what}: {field_name} names argument {arg!r} but {FORWARD}() takes {sorted(arg_names)}"
                )
            _checked(what, f"{field_name}[{arg!r}]", named, names)
    for field_name in ("out_src_shardings", "out_dst_shardings"):
        for out, named in getattr(sc, field_name).items():
            if not _OUTPUT_NAME.match(str(out)):
                raise ValueError(
                    f"{what}: {field_name} key {out!r} is not 'output' (a single output) or 'output<i>' "
                    f"(item i of a tuple output)"
                )
            _checked(what, f"{field_name}[{out!r}]", named, names)


def _src(value: Any) -> int | None:
    return None if getattr(value, "is_meta", False) else 0


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
            _plat.register_param(self, name, p)
        for name, b in _plat.direct_buffers(module):
            _plat.register_buffer(self, name, b)
        for name, child in _plat.named_children(module):
            _plat.add_child(self, name, child)
        self._adopted_forward = getattr(type(module), FORWARD)
        self.adopted_type = type(module)
        for attr, value in vars(module).items():
            if not attr.startswith("_") and attr not in vars(self) and not hasattr(type(self), attr):
                setattr(self, attr, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._adopted_forward(self, *args, **kwargs)

    construct = forward


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
            _plat.add_child(self, str(i), m)

    def forward(self, x: Any) -> Any:
        for m in children_of(self):
            x = m(x)
        return x

    construct = forward
