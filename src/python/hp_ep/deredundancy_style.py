"""``DeredundancyExpertParallel``: ``ExpertParallel``'s sharding with the de-duplicating dispatcher.

The experts are sharded over the 1-D ep mesh exactly as ``ExpertParallel`` shards them; the ep
ranks are grouped into nodes of ``npu_nums_per_device`` consecutive ranks (consecutive global
ranks when ``ep`` is the innermost mesh dim, as on the sparse mesh), and tokens move in two
stages (see ``hp_ep.deredundancy``): each token crosses to a node once, however many of its
experts live there, then an all-to-all inside the node brings its copies to the expert ranks.
The combine sums a token's weighted copies on the node before the one row per node travels back.

The experts module must be called per token, ``forward(x, counts, token_index, weights)``: the
token index of each copy is what lets copies share one row, and the routing weights are applied
where the copies are summed.  Backward runs every exchange in reverse, so gradients (the routing
weights' included) equal one process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hp_dtensor import DeviceMesh
from hp_dtensor.platform import current as _platform
from hp_ep.deredundancy import DeredundancyPlan, NodeReceive, NodeSend, plan_node_receive, plan_node_send
from hp_ep.dispatch import DispatchPlan, inverse
from hp_ep.dispatcher import TokenDispatcher, check_deredundancy_nodes
from hp_ep.primitives import ep_primitives
from hp_ep.style import ExpertParallel, shard_stacked_experts, split_copy_inputs
from hp_tp import ParallelStyle

_NODE_DIMS = ("ep_node", "ep_local")


@dataclasses.dataclass(slots=True)
class _Pending:
    """One forward's state kept from dispatch to combine."""

    plan: DeredundancyPlan
    order: list[int]
    send: NodeSend
    receive: NodeReceive
    tokens: Any
    rows: Any
    weights: Any


class DeredundancyExpertParallel(ParallelStyle):
    """Shard the experts of one module over a 1-D ``ep`` mesh and dispatch each token once per
    destination node of ``npu_nums_per_device`` ranks.

    ``ValueError`` when ``npu_nums_per_device`` exceeds or does not divide the ep size (named with
    both numbers), for the conditions ``ExpertParallel`` refuses, and for an ep mesh not sliced from
    a mesh over every rank (the node groups are created on every rank from it).  ``plans`` lists
    each forward's ``DeredundancyPlan`` on this rank (``clear_plans()`` empties it)."""

    def __init__(self, npu_nums_per_device: int) -> None:
        self.npu_nums_per_device = npu_nums_per_device
        self.plans: list[DeredundancyPlan] = []
        self._pending: list[_Pending] = []
        self._node_mesh: DeviceMesh | None = None

    def clear_plans(self) -> None:
        self.plans.clear()

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"DeredundancyExpertParallel needs a 1-D ep mesh, got {device_mesh.ndim} dims "
                f"{device_mesh.mesh_dim_names}; pass mesh['ep']"
            )
        self.nodes = check_deredundancy_nodes(device_mesh.size(), self.npu_nums_per_device)
        self.num_experts, self.local_experts = shard_stacked_experts(self, module, device_mesh)
        self._node_mesh = _node_mesh(device_mesh, self.nodes, self.npu_nums_per_device)
        plat = _platform()
        plat.register_forward_pre_hook(module, self._dispatch)
        plat.register_forward_hook(module, self._combine)
        return module

    def _dispatch(self, module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        assert self._node_mesh is not None
        prims = ep_primitives()
        per_token = split_copy_inputs(inputs, "DeredundancyExpertParallel")
        if per_token is None:
            raise ValueError(
                "DeredundancyExpertParallel: the experts module must be called per token, "
                "(x, counts, token_index, weights), so copies of one token can share a row"
            )
        token_index, weights = per_token
        tokens, counts = prims.local_of(inputs[0]), inputs[1]
        send_counts = prims.to_list(counts)
        if len(send_counts) != self.num_experts:
            raise ValueError(
                f"DeredundancyExpertParallel: got token counts for {len(send_counts)} experts, the module stacks "
                f"{self.num_experts}"
            )
        n, node_experts = self.npu_nums_per_device, self.npu_nums_per_device * self.local_experts
        outer, inner = self._node_mesh.get_group(0), self._node_mesh.get_group(1)
        send = plan_node_send(send_counts, prims.to_list(token_index), self.nodes, node_experts)
        sizes = [v for d in range(self.nodes) for v in (send.unique[d], send.copies[d])]
        got = prims.to_list(prims.exchange_counts(prims.int_tensor(sizes, counts), outer, self.nodes))
        recv_unique, recv_copies = tuple(got[0::2]), tuple(got[1::2])
        # outer stage: each token once per node, its copies' weights and descriptors alongside
        rows = prims.all_to_all_rows(prims.take_rows(tokens, send.tokens), recv_unique, send.unique, outer)
        recv_weights = prims.all_to_all_rows(prims.local_of(weights), recv_copies, send.copies, outer)
        meta = prims.all_to_all_rows(prims.int_tensor(send.meta, counts), recv_copies, send.copies, outer)
        receive = plan_node_receive(recv_unique, recv_copies, prims.to_list(meta), node_experts)
        # inner stage: the copies to the expert ranks of this node, as the plain all-to-all does
        inner_recv = prims.to_list(prims.exchange_counts(prims.int_tensor(receive.send_counts, counts), inner, n))
        inner_plan = DispatchPlan(n, self.local_experts, receive.send_counts, tuple(inner_recv))
        copies = prims.take_rows(rows, receive.rows)
        arrived = prims.all_to_all_rows(copies, inner_plan.recv_splits, inner_plan.send_splits, inner)
        plan = DeredundancyPlan(
            nodes=self.nodes, node=self._node_mesh.get_local_rank(0), node_size=n,
            local_experts=self.local_experts, send_counts=tuple(send_counts), send_unique=send.unique,
            send_copies=send.copies, recv_unique=recv_unique, recv_copies=recv_copies, inner=inner_plan,
        )
        order = inner_plan.group_order()
        self._pending.append(_Pending(plan, order, send, receive, tokens, rows, recv_weights))
        self.plans.append(plan)
        return (prims.take_rows(arrived, order), prims.int_tensor(inner_plan.local_counts, counts))

    def _combine(self, module: Any, inputs: Any, output: Any) -> Any:
        assert self._node_mesh is not None
        prims = ep_primitives()
        p = self._pending.pop()
        outer, inner = self._node_mesh.get_group(0), self._node_mesh.get_group(1)
        back = prims.take_rows(prims.local_of(output), inverse(p.order))
        copies = prims.all_to_all_rows(back, p.plan.inner.send_splits, p.plan.inner.recv_splits, inner)
        weighted = prims.scale_rows(copies, prims.take_rows(p.weights, p.receive.copy_order))
        per_token = prims.sum_rows(weighted, p.receive.rows, p.rows)  # one row per received token
        rows = prims.all_to_all_rows(per_token, p.send.unique, p.plan.recv_unique, outer)
        return prims.sum_rows(rows, p.send.tokens, p.tokens)


def _node_mesh(ep_mesh: DeviceMesh, nodes: int, node_size: int) -> DeviceMesh:
    """This rank's ``(ep_node, ep_local)`` mesh.  Every rank builds the node meshes of every ep
    group of the mesh ``ep_mesh`` was sliced from, in one order, since creating a process group is
    collective."""
    plat = _platform()
    root = ep_mesh.get_root_mesh()
    world = plat.get_world_size()
    if sorted(root.layout.ranks) != list(range(world)):
        raise ValueError(
            f"DeredundancyExpertParallel needs an ep mesh sliced from a mesh over all {world} ranks "
            f"(init_device_mesh or ParallelDims.build_mesh), got one from ranks {list(root.layout.ranks)}"
        )
    if root is ep_mesh:
        groups = [ep_mesh.layout.ranks]
    else:
        names = ep_mesh.mesh_dim_names
        assert names is not None  # a sliced mesh is sliced by name
        groups = root.layout.groups_along(root.layout.dim_index(names[0]))
    mine: DeviceMesh | None = None
    for g in groups:
        grid = [[g[d * node_size + i] for i in range(node_size)] for d in range(nodes)]
        mesh = DeviceMesh(ep_mesh.device_type, grid, mesh_dim_names=_NODE_DIMS)
        if mesh.get_coordinate() is not None:
            mine = mesh
    assert mine is not None  # this rank is in its own ep group
    return mine


ExpertParallelStyle = ExpertParallel | DeredundancyExpertParallel


def make_expert_parallel(
    dispatcher: TokenDispatcher = TokenDispatcher.ALLTOALL, *, npu_nums_per_device: int = 8
) -> ExpertParallelStyle:
    """The expert-parallel style of a dispatcher kind: ``ExpertParallel`` for ``ALLTOALL``,
    ``DeredundancyExpertParallel(npu_nums_per_device)`` for ``ALLTOALL_DEREDUNDANCY``
    (``npu_nums_per_device`` is read only by the latter)."""
    if not isinstance(dispatcher, TokenDispatcher):
        raise TypeError(
            f"dispatcher must be a TokenDispatcher, got {dispatcher!r}; convert a job file's name with "
            f"TokenDispatcher.from_name"
        )
    if dispatcher is TokenDispatcher.ALLTOALL_DEREDUNDANCY:
        return DeredundancyExpertParallel(npu_nums_per_device)
    return ExpertParallel()
