"""Model and optimizer state dicts keyed by parameter name, for sharded checkpoints.

``torch.optim`` keys its state by parameter position, which ties a checkpoint to one model
construction and one parallelism.  Keyed by the parameter's fully qualified name (FQN) instead,
and holding the DTensors themselves (no copies, no gathers), the dicts below can be saved with
``dcp.save`` under one layout and loaded in place with ``dcp.load`` under any other.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> FQN (the first name of a shared parameter, as ``named_parameters``)."""
    return {id(p): name for name, p in model.named_parameters()}


def _optim_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def _fqn_list(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[str]:
    names = _param_names(model)
    out = []
    for p in _optim_params(optim):
        if id(p) not in names:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter of "
                f"{type(model).__name__}: pass the model the optimizer was built on"
            )
        out.append(names[id(p)])
    return out


def get_model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()``: sharded parameters stay DTensors sharing the parameters' storage, so
    ``dcp.load`` into this dict loads the model in place."""
    return dict(model.state_dict())


def set_model_state_dict(model: torch.nn.Module, state_dict: dict[str, Any], *, strict: bool = True) -> None:
    """Copy ``state_dict`` into the model (a no-op for entries ``dcp.load`` already filled in
    place); missing or unexpected keys raise under ``strict``."""
    current = model.state_dict()
    for name, value in state_dict.items():
        target = current.get(name)
        if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
            if _same_storage(value, target):
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"set_model_state_dict: {name!r} has global shape {tuple(value.shape)}, the model's "
                    f"parameter has {tuple(target.shape)}"
                )
    model.load_state_dict(state_dict, strict=strict)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    from hp_dtensor.platform.torch.dtensor import DTensor

    la = a._local_tensor if isinstance(a, DTensor) else a
    lb = b._local_tensor if isinstance(b, DTensor) else b
    return bool(la.untyped_storage().data_ptr() == lb.untyped_storage().data_ptr() and la.shape == lb.shape)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors where missing, so that a checkpoint has somewhere to
    load into: one step at learning rate 0 on zero gradients (parameters unchanged bit for bit:
    weight decay multiplies by exactly 1), then every ``step`` counter back to 0, so the state is
    exactly what the optimizer's own first step starts from."""
    params = _optim_params(optim)
    if all(p in optim.state and optim.state[p] for p in params):
        return
    if any(p.grad is not None for p in params):
        raise ValueError(
            "get_optimizer_state_dict: the optimizer has no state yet but parameters hold gradients; "
            "call it before backward or after optimizer.step()/zero_grad()"
        )
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    saved_lr = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, saved_lr):
            g["lr"] = lr
        optim.zero_grad(set_to_none=True)
    for state in optim.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def get_optimizer_state_dict(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {name: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}``: the
    optimizer's own state tensors (DTensors for sharded parameters, no copies), keyed by parameter
    name so a load reshards them with the parameters.  State missing before the first step is
    created as the first step would start it."""
    fqns = _fqn_list(model, optim)
    _init_optim_state(optim)
    params = _optim_params(optim)
    state = {fqn: dict(optim.state[p]) for fqn, p in zip(fqns, params) if p in optim.state}
    groups = []
    i = 0
    for g in optim.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns[i : i + n]})
        i += n
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(
    model: torch.nn.Module, optim: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load an FQN-keyed optimizer state dict (``get_optimizer_state_dict``'s form) into ``optim``.
    Raises ``ValueError`` naming the parameter when a name is unknown or missing."""
    fqns = _fqn_list(model, optim)
    index = {fqn: i for i, fqn in enumerate(fqns)}
    unknown = sorted(set(state_dict.get("state", {})) - set(index))
    if unknown:
        raise ValueError(f"set_optimizer_state_dict: state for unknown parameters {unknown}")
    groups = state_dict.get("param_groups", [])
    if len(groups) != len(optim.param_groups):
        raise ValueError(
            f"set_optimizer_state_dict: {len(groups)} parameter groups saved, the optimizer has "
            f"{len(optim.param_groups)}"
        )
    new_groups = []
    i = 0
    for saved, own in zip(groups, optim.param_groups):
        own_names = fqns[i : i + len(own["params"])]
        names = list(saved["params"])
        if sorted(names) != sorted(own_names):
            raise ValueError(
                f"set_optimizer_state_dict: a saved parameter group holds {sorted(names)}, the "
                f"optimizer's group holds {sorted(own_names)}"
            )
        # positions in the optimizer's own order: load_state_dict pairs saved and current
        # parameters by position, and the state below is keyed by the same positions
        new_groups.append({**saved, "params": list(range(i, i + len(own_names)))})
        i += len(own_names)
    state = {index[fqn]: v for fqn, v in state_dict.get("state", {}).items()}
    optim.load_state_dict({"state": state, "param_groups": new_groups})


def stage_to_cpu(state_dict: Any) -> Any:
    """A copy of a nested state dict whose tensors no later update can reach: DTensors become
    DTensors of the same layout over cloned CPU shards, tensors CPU clones, other values deep
    copies.  What an asynchronous save writes while training goes on."""
    from hp_dtensor.platform.torch.dtensor import DTensor

    def one(value: Any) -> Any:
        if isinstance(value, DTensor):
            local = value._local_tensor.detach().to("cpu", copy=True)
            return DTensor.from_local(local, value.device_mesh, value.placements, shape=tuple(value.shape))
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        if isinstance(value, list):
            return [one(v) for v in value]
        return copy.deepcopy(value)

    return one(state_dict)
