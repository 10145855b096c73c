"""``ExpertParallel``: stacked experts sharded over the ``ep`` mesh dim, tokens moved to them.

Applied (through ``hp_tp.parallelize_module``) to a grouped-experts module whose parameters stack
the experts on dim 0 and whose ``forward(x, counts)`` takes token rows grouped by expert with one
count per expert, or ``forward(x, counts, token_index, weights)`` the tokens with one index and
routing weight per routed copy (copies grouped by expert) and returns each token's weighted sum
of its copies.  Each parameter becomes a ``Shard(0)`` DTensor on the 1-D ep mesh; around the
forward the style exchanges the counts, sends every row (every token copy) to the rank holding
its expert (one all-to-all with variable split sizes), regroups the received rows by local
expert, runs the local experts, and sends the results back in the original order, where the
copies are weighted and summed per token.  Backward runs the reverse all-to-alls, so gradients
are exact; no row is dropped.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor import DeviceMesh, Shard
from hp_dtensor.platform import current as _platform
from hp_ep.dispatch import DispatchPlan, check_experts_divisible, count_message, inverse, read_count_messages
from hp_ep.primitives import ep_primitives
from hp_tp import ParallelStyle


class ExpertParallel(ParallelStyle):
    """Shard the experts of one module over a 1-D ``ep`` mesh and dispatch tokens to them.

    ``plans`` lists each forward's ``DispatchPlan`` on this rank (tests and the trainer's summary
    read the token counts from it; ``clear_plans()`` empties it)."""

    def __init__(self) -> None:
        self.plans: list[DispatchPlan] = []
        self._pending: list[tuple[DispatchPlan, list[int], tuple[Any, ...]]] = []
        self._mesh: DeviceMesh | None = None

    def clear_plans(self) -> None:
        self.plans.clear()

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"ExpertParallel needs a 1-D ep mesh, got {device_mesh.ndim} dims {device_mesh.mesh_dim_names}; "
                f"pass mesh['ep']"
            )
        self.num_experts, self.local_experts = shard_stacked_experts(self, module, device_mesh)
        self._mesh = device_mesh
        plat = _platform()
        plat.register_forward_pre_hook(module, self._dispatch)
        plat.register_forward_hook(module, self._combine)
        return module

    def _dispatch(self, module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        assert self._mesh is not None
        prims = ep_primitives()
        x, counts = inputs[0], inputs[1]
        per_token = split_copy_inputs(inputs, "ExpertParallel")
        if per_token is not None:  # one row per routed copy of a token
            x = prims.take_rows(prims.local_of(x), prims.to_list(per_token[0]))
        send = prims.to_list(counts)
        ep, group = self._mesh.size(), self._mesh.get_group(0)
        # Counts are checked after the exchange, so a bad caller on one rank fails every rank of the group.
        message = count_message(send, int(prims.local_of(x).shape[0]), self.num_experts, ep)
        recv = read_count_messages(prims.to_list(prims.exchange_counts(prims.int_tensor(message, counts), group, ep)),
                                   self.num_experts, ep)
        plan = DispatchPlan(ep, self.local_experts, tuple(send), recv)
        received = prims.all_to_all_rows(prims.local_of(x), plan.recv_splits, plan.send_splits, group)
        order = plan.group_order()
        self._pending.append((plan, order, () if per_token is None else (inputs[0], *per_token)))
        self.plans.append(plan)
        return (prims.take_rows(received, order), prims.int_tensor(plan.local_counts, counts))

    def _combine(self, module: Any, inputs: Any, output: Any) -> Any:
        assert self._mesh is not None
        prims = ep_primitives()
        plan, order, per_token = self._pending.pop()
        back = prims.take_rows(prims.local_of(output), inverse(order))
        rows = prims.all_to_all_rows(back, plan.send_splits, plan.recv_splits, self._mesh.get_group(0))
        if not per_token:
            return rows
        tokens, token_index, weights = per_token
        tokens = prims.local_of(tokens)
        return prims.sum_rows(prims.scale_rows(rows, weights), prims.to_list(token_index), tokens)


def split_copy_inputs(inputs: tuple[Any, ...], style: str) -> tuple[Any, Any] | None:
    """``(token_index, weights)`` when the experts were called per token (see the module
    docstring), None when called on grouped rows; ``ValueError`` for any other argument list."""
    if len(inputs) == 2:
        return None
    if len(inputs) == 4 and inputs[2] is not None and inputs[3] is not None:
        return inputs[2], inputs[3]
    raise ValueError(
        f"{style}: the experts module must be called as (x, counts) or (x, counts, token_index, weights), "
        f"got {len(inputs)} arguments"
    )


def shard_stacked_experts(style: ParallelStyle, module: Any, mesh: DeviceMesh) -> tuple[int, int]:
    """Turn each of ``module``'s stacked expert parameters into a ``Shard(0)`` DTensor on the 1-D
    ``mesh``; ``(num_experts, experts per rank)``.  ``ValueError`` for a module without parameters,
    parameters stacking different expert counts, or an expert count ``mesh`` does not divide."""
    plat = _platform()
    name_of = type(style).__name__
    params = [(name, p) for name, p in plat.direct_params(module) if p is not None]
    if not params:
        raise ValueError(f"{name_of}: {type(module).__name__} holds no parameters to shard")
    experts = {int(p.shape[0]) for _, p in params}
    if len(experts) != 1:
        raise ValueError(
            f"{name_of}: {type(module).__name__}'s parameters stack different expert counts "
            f"{sorted(experts)} on dim 0"
        )
    num_experts = experts.pop()
    local_experts = check_experts_divisible(num_experts, mesh.size())
    for name, p in params:
        if not isinstance(p, plat.DTensor):
            plat.set_param(module, name, plat.distribute_tensor(
                p.data, mesh, [Shard(0)], src_data_rank=style._src_for(p)))
    return num_experts, local_experts
