"""``fully_shard``: FSDP2's API on hyper-parallel DTensors.

``fully_shard(module)`` turns every parameter of ``module``'s tree that no nested ``fully_shard``
took into a ``Shard(0)`` DTensor over the data-parallel ranks (padded internally when dim 0 does
not divide), and makes ``module`` an ``FSDPModule``: one all_gather before its forward (and again
before its backward when it resharded after forward -- over a smaller group when it resharded to
one), one reduce_scatter of its gradients after backward (and one all_reduce across replicas under
HSDP).  Apply it bottom-up: blocks first, then the root.  After tensor parallelism, pass only
the data-parallel slice of the mesh: a TP DTensor parameter keeps its TP placement and is sharded
over the data-parallel dims on top of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, TypeVar

from hp_dtensor import DeviceMesh, init_device_mesh
from hp_dtensor.device_mesh import get_current_mesh
from hp_dtensor.platform import current as _platform
from hp_fsdp.mesh_info import FSDPMeshInfo, post_forward_group
from hp_fsdp.param import FSDPParam, make_fsdp_param
from hp_fsdp.param_group import FSDPParamGroup
from hp_fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.primitives import fsdp_primitives
from hp_fsdp.state import FSDPState

M = TypeVar("M")

_STATE = "_hp_fsdp_state"
# Notices said once per process (a model calls fully_shard once per block).
_notices_given: dict[str, bool] = {}


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to (``isinstance(m,
    FSDPModule)``), with FSDP2's controls."""

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [getattr(self, _STATE)]
        out = []
        for _name, sub in _platform().named_modules(self):
            st = getattr(sub, _STATE, None)
            if isinstance(st, FSDPState):
                out.append(st)
        return out

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """After a conversion of the whole module (``to_empty`` after meta-device init, ``to``,
        ``double()``...), the sharded parameters the modules hold are the new truth: the group
        takes them and rebuilds its unsharded buffers on the new device and dtype."""
        group = getattr(self, _STATE).group
        if group is not None:
            group.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if group is not None:
            group.adopt_converted_params()
        return out

    def unshard(self, async_op: bool = False) -> None:
        """Gather this module's parameters now (``async_op``: start it; the next forward or a
        later ``unshard()`` waits for it)."""
        group = getattr(self, _STATE).group
        if group is not None:
            group.unshard(async_op=async_op)
            if not async_op:
                group.wait_unshard()

    def reshard(self) -> None:
        """Free this module's unsharded parameters; the modules hold the sharded ones again."""
        group = getattr(self, _STATE).group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False for the micro-steps of gradient accumulation: no reduce_scatter, gradients
        accumulate unsharded until a backward with sync on reduces them all at once."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reduce_grads = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the gathered parameters after backward (the microbatches of a pipeline step
        but its last: the next microbatch's forward and backward then gather nothing); True (the
        default) frees them once backward is done with them.  A bool, as in torch."""
        if not isinstance(reshard_after_backward, bool):
            raise ValueError(
                f"set_reshard_after_backward takes a bool, got {reshard_after_backward!r} "
                f"({type(reshard_after_backward).__name__})"
            )
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Reshard after forward (True: over the whole shard group) or not (False), from the next
        forward on; replaces a ``reshard_after_forward=<int>`` given to ``fully_shard``.  Only a
        bool, as in torch: an int here would read as a group size."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r} "
                f"({type(reshard_after_forward).__name__}); a group size to reshard to is given to fully_shard"
            )
        for st in self._fsdp_states(recurse):
            st.auto_reshard = False
            if st.group is not None:
                st.group.reshard_after_forward = reshard_after_forward
                st.group.post_forward_group = None

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size (1.0: sum)."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be > 0, got {factor!r}")
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.divide_factor = float(factor)


def fully_shard(
    module: M,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: Iterable[Any] | None = None,
) -> M:
    """Shard ``module``'s parameters over ``mesh`` (default: the current ``with mesh:``, else, as
    torch's, a 1-D mesh over the whole world on the accelerator when there is one), FSDP2
    semantics.  ``mesh`` 1-D: FSDP; 2-D ``(replicate, shard)``: HSDP.  ``reshard_after_forward``:
    True frees the gathered parameters after forward and gathers again for backward; False keeps
    them until after backward; None (default) is True except for the root, whose parameters
    backward needs first; an int ``k`` dividing the shard group's size ``n`` reshards to groups
    of ``k`` consecutive ranks of the shard group: between forward and backward each rank holds
    ``1/k`` of the parameters and backward gathers over ``k`` ranks (``k == n``: True; ``k == 1``:
    False, with a warning, as in torch).  Returns ``module``, now also an ``FSDPModule``."""
    plat = _platform()
    prims = fsdp_primitives()
    if not plat.is_module(module):
        raise TypeError(f"fully_shard takes a module, got {type(module).__name__}")
    if isinstance(getattr(module, _STATE, None), FSDPState):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    if mesh is None:
        mesh = get_current_mesh() or _default_mesh()
    elif not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    info = FSDPMeshInfo(mesh)
    reshard = _check_reshard(reshard_after_forward, info)
    # Creating the smaller groups is collective: every rank does it here, before anything can differ.
    pf_group = None
    if isinstance(reshard, int) and not isinstance(reshard, bool):
        pf_group = post_forward_group(info, reshard)
    mp = mp_policy or MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp).__name__}")
    offload = offload_policy or OffloadPolicy()
    if not isinstance(offload, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload).__name__}")

    ignored = {id(p) for p in (ignored_params or ())}
    managed = _params_to_manage(module, ignored)
    compute_device = prims.device_of(managed[0][2]) if managed else None
    offload_device: object | None = None
    if isinstance(offload, CPUOffloadPolicy) and managed:
        if getattr(compute_device, "type", str(compute_device)) == "cpu":
            if not _notices_given.get("offload_on_cpu"):
                _notices_given["offload_on_cpu"] = True
                warnings.warn(
                    "CPUOffloadPolicy: the parameters already live in host memory (a CPU job), so there is "
                    "nothing to offload; fully_shard keeps them where they are",
                    UserWarning, stacklevel=2,
                )
        else:
            offload_device = "cpu"
    fparams: list[FSDPParam] = [
        make_fsdp_param(prims, info, fqn, owners, param, offload_device,
                        isinstance(offload, CPUOffloadPolicy) and offload.pin_memory)
        for fqn, owners, param in managed
    ]
    group = None
    if fparams:
        group = FSDPParamGroup(prims, fparams, info, mp, compute_device, offload_device is not None)
        group.reshard_after_forward = True if reshard is None else bool(reshard)
        group.post_forward_group = pf_group
    # Everything that can fail ran before any module changes, so a failed call leaves the tree as it was.
    for fp in fparams:
        for owner, name in fp.owners:
            plat.share_param(owner, name, fp.sharded_param)
    state = FSDPState(prims, module, group, mp, auto_reshard=reshard is None)
    object.__setattr__(module, _STATE, state)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})  # type: ignore[assignment]
    return module


def _default_mesh() -> DeviceMesh:
    """torch's default mesh: 1-D over every rank of the job, on the accelerator when there is one
    (the process group starts from the launcher's environment when none exists)."""
    plat = _platform()
    device_type = plat.default_device_type()
    plat.ensure_process_group(device_type)
    return init_device_mesh(device_type, (plat.get_world_size(),))


def _check_reshard(value: bool | int | None, info: FSDPMeshInfo) -> bool | int | None:
    """None, a bool, or an int ``1 < k < n`` dividing the shard group's size ``n`` (torch's rules:
    ``n`` means True, ``1`` means False and warns, anything else is a ``ValueError``)."""
    if value is None or isinstance(value, bool):
        return value
    n = info.shard_size
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward must be None, a bool or an int group size, got {value!r} "
            f"({type(value).__name__})"
        )
    if value < 1 or n % value:
        sizes = [k for k in range(1, n + 1) if n % k == 0]
        raise ValueError(
            f"reshard_after_forward={value}: an int is the size of the groups the parameters are "
            f"resharded to after forward and must divide the shard group's {n} ranks (one of {sizes}); "
            f"pass True to reshard over the whole shard group, False to keep the parameters gathered"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) reshards to groups of one rank, which keeps the parameters "
            "gathered after forward like reshard_after_forward=False; pass True (bool) to reshard over "
            "the whole shard group",
            UserWarning, stacklevel=3,
        )
        return False
    if value == n:
        return True
    return value


def _params_to_manage(module: Any, ignored: set[int]) -> list[tuple[str, list[tuple[object, str]], Any]]:
    """(fqn, every (module, name) holding it, parameter) for each parameter of ``module``'s tree
    that no nested ``fully_shard`` manages and that is not ignored, in registration order."""
    plat = _platform()
    found: dict[int, tuple[str, list[tuple[object, str]], Any]] = {}
    taken: set[int] = set()
    for _prefix, sub in plat.named_modules(module):
        st = getattr(sub, _STATE, None)
        if sub is not module and isinstance(st, FSDPState) and st.group is not None:
            for p in st.group.params:
                taken.add(id(p.sharded_param))
                if p.unsharded_param is not None:
                    taken.add(id(p.unsharded_param))
    for prefix, sub in plat.named_modules(module):
        for name, param in plat.direct_params(sub):
            if param is None or id(param) in taken or id(param) in ignored:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if id(param) in found:
                found[id(param)][1].append((sub, name))
            else:
                found[id(param)] = (fqn, [(sub, name)], param)
    return list(found.values())
