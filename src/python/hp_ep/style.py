"""``ExpertParallel``: stacked experts sharded over the ``ep`` mesh dim, tokens moved to them.

Applied (through ``hp_tp.parallelize_module``) to a grouped-experts module whose parameters stack
the experts on dim 0 and whose ``forward(x, counts)`` takes token rows grouped by expert with one
count per expert.  Each parameter becomes a ``Shard(0)`` DTensor on the 1-D ep mesh; around the
forward the style exchanges the counts, sends every row to the rank holding its expert (one
all-to-all with variable split sizes), regroups the received rows by local expert, runs the local
experts, and sends the results back in the original order.  Backward runs the reverse
all-to-alls, so gradients are exact; no row is dropped.
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
        self._pending: list[tuple[DispatchPlan, list[int]]] = []
        self._mesh: DeviceMesh | None = None

    def clear_plans(self) -> None:
        self.plans.clear()

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"ExpertParallel needs a 1-D ep mesh, got {device_mesh.ndim} dims {device_mesh.mesh_dim_names}; "
                f"pass mesh['ep']"
            )
        plat = _platform()
        ep = device_mesh.size()
        params = [(name, p) for name, p in plat.direct_params(module) if p is not None]
        if not params:
            raise ValueError(f"ExpertParallel: {type(module).__name__} holds no parameters to shard")
        experts = {int(p.shape[0]) for _, p in params}
        if len(experts) != 1:
            raise ValueError(
                f"ExpertParallel: {type(module).__name__}'s parameters stack different expert counts "
                f"{sorted(experts)} on dim 0"
            )
        self.num_experts = experts.pop()
        self.local_experts = check_experts_divisible(self.num_experts, ep)
        for name, p in params:
            if not isinstance(p, plat.DTensor):
                plat.set_param(module, name, plat.distribute_tensor(
                    p.data, device_mesh, [Shard(0)], src_data_rank=self._src_for(p)))
        self._mesh = device_mesh
        plat.register_forward_pre_hook(module, self._dispatch)
        plat.register_forward_hook(module, self._combine)
        return module

    def _dispatch(self, module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        assert self._mesh is not None
        prims = ep_primitives()
        x, counts = inputs[0], inputs[1]
        send = prims.to_list(counts)
        ep, group = self._mesh.size(), self._mesh.get_group(0)
        # Counts are checked after the exchange, so a bad caller on one rank fails every rank of the group.
        message = count_message(send, int(prims.local_of(x).shape[0]), self.num_experts, ep)
        recv = read_count_messages(prims.to_list(prims.exchange_counts(prims.int_tensor(message, counts), group, ep)),
                                   self.num_experts, ep)
        plan = DispatchPlan(ep, self.local_experts, tuple(send), recv)
        received = prims.all_to_all_rows(prims.local_of(x), plan.recv_splits, plan.send_splits, group)
        order = plan.group_order()
        self._pending.append((plan, order))
        self.plans.append(plan)
        return (prims.take_rows(received, order), prims.int_tensor(plan.local_counts, counts), *inputs[2:])

    def _combine(self, module: Any, inputs: Any, output: Any) -> Any:
        assert self._mesh is not None
        prims = ep_primitives()
        plan, order = self._pending.pop()
        back = prims.take_rows(prims.local_of(output), inverse(order))
        return prims.all_to_all_rows(back, plan.send_splits, plan.recv_splits, self._mesh.get_group(0))
