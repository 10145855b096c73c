"""``ExpertTensorParallel``: experts sharded over ``ep`` and, inside each expert, over ``etp``.

When the ep group is smaller than the TP group, the ``etp = tp // ep`` TP ranks that share an ep
coordinate would otherwise hold the same experts.  This style splits each expert over them the
way tensor parallelism splits an MLP: the gate and up projections ``(E, I, H)`` by output column
(``Shard(1)``), the down projection ``(E, H, I)`` by input row (``Shard(2)``), so a rank holds
``1 / (ep * etp)`` of the expert weights.  Tokens first reach their expert's ep rank by
``ExpertParallel``'s all-to-all; then the etp ranks pool the rows they received (the counts, then
the rows, all-gathered over ``etp``), each runs every pooled row through its column slice --
SwiGLU is elementwise in the intermediate dim, so the down projection gives a partial sum -- and a
reduce-scatter over ``etp`` returns each rank the full outputs of its own rows.  Backward is the
adjoint of each step (the all-gather's is a reduce-scatter and vice versa), so gradients equal one
process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hp_dtensor import DeviceMesh, Placement, Shard
from hp_dtensor.platform import current as _platform
from hp_ep.dispatch import DispatchPlan, check_experts_divisible, inverse
from hp_ep.primitives import ep_primitives
from hp_ep.style import ExpertParallel


class ExpertTensorParallel(ExpertParallel):
    """Apply to a grouped-experts module on a 2-D ``(ep, etp)`` mesh (``ep_etp_mesh`` joins the
    two 1-D dims of one mesh).  ``column`` names the parameters split by output column (dim 1 of
    ``(E, out, in)``), ``row`` those split by input row (dim 2); the module must hold exactly
    these.  ``ValueError`` for another mesh shape, other parameters, or an expert count the ep
    size does not divide.  ``plans`` holds each forward's ep ``DispatchPlan`` as in
    ``ExpertParallel``."""

    def __init__(
        self, *, column: Sequence[str] = ("gate_proj", "up_proj"), row: Sequence[str] = ("down_proj",)
    ) -> None:
        super().__init__()
        self.column, self.row = tuple(column), tuple(row)
        self._etp_mesh: DeviceMesh | None = None
        self._etp_pending: list[tuple[Any, list[int], list[int]]] = []

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        names = device_mesh.mesh_dim_names
        if device_mesh.ndim != 2 or names is None:
            raise ValueError(
                f"ExpertTensorParallel needs a 2-D (ep, etp) mesh with dim names, got {device_mesh.ndim} dims "
                f"{names}; pass ep_etp_mesh(mesh['ep'], mesh['etp'])"
            )
        plat = _platform()
        params = {name: p for name, p in plat.direct_params(module) if p is not None}
        if set(params) != set(self.column) | set(self.row):
            raise ValueError(
                f"ExpertTensorParallel: {type(module).__name__} holds parameters {sorted(params)}, the style splits "
                f"columns of {list(self.column)} and rows of {list(self.row)}; name them with column=/row="
            )
        experts = {int(p.shape[0]) for p in params.values()}
        if len(experts) != 1:
            raise ValueError(
                f"ExpertTensorParallel: {type(module).__name__}'s parameters stack different expert counts "
                f"{sorted(experts)} on dim 0"
            )
        self.num_experts = experts.pop()
        self.local_experts = check_experts_divisible(self.num_experts, device_mesh.size(0))
        for name, p in params.items():
            split: Placement = Shard(1) if name in self.column else Shard(2)
            if not isinstance(p, plat.DTensor):
                plat.set_param(module, name, plat.distribute_tensor(
                    p.data, device_mesh, [Shard(0), split], src_data_rank=self._src_for(p)))
        self._mesh, self._etp_mesh = device_mesh[names[0]], device_mesh[names[1]]
        plat.register_forward_pre_hook(module, self._dispatch_etp)
        plat.register_forward_hook(module, self._combine_etp)
        return module

    def _dispatch_etp(self, module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        assert self._etp_mesh is not None
        prims = ep_primitives()
        rows, counts = self._dispatch(module, inputs)  # this rank's rows for its experts, grouped
        etp, group = self._etp_mesh.size(), self._etp_mesh.get_group(0)
        mine = prims.to_list(counts)
        # every etp rank's per-expert counts, then its rows: the pool each column slice runs
        pooled_counts = prims.to_list(prims.exchange_counts(prims.int_tensor(mine * etp, counts), group, etp))
        pool = DispatchPlan(etp, self.local_experts, tuple(mine * etp), tuple(pooled_counts))
        n_rows = sum(mine)
        pooled = prims.all_to_all_rows(
            prims.take_rows(rows, list(range(n_rows)) * etp), pool.recv_splits, [n_rows] * etp, group
        )
        order = pool.group_order()
        self._etp_pending.append((rows, order, list(pool.recv_splits)))
        return (prims.take_rows(pooled, order), prims.int_tensor(pool.local_counts, counts))

    def _combine_etp(self, module: Any, inputs: Any, output: Any) -> Any:
        assert self._etp_mesh is not None
        prims = ep_primitives()
        rows, order, splits = self._etp_pending.pop()
        n_rows = int(rows.shape[0])
        etp, group = self._etp_mesh.size(), self._etp_mesh.get_group(0)
        partial = prims.take_rows(prims.local_of(output), inverse(order))  # back to source-rank order
        mine = prims.all_to_all_rows(partial, [n_rows] * etp, splits, group)  # each rank's partials of my rows
        summed = prims.sum_rows(mine, list(range(n_rows)) * etp, rows)
        return self._combine(module, inputs, summed)


def ep_etp_mesh(ep_mesh: DeviceMesh, etp_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D ``(ep, etp)`` mesh of two 1-D dims sliced by name from one mesh; ``ValueError`` when
    they were not."""
    root = ep_mesh.get_root_mesh()
    ep_names, etp_names = ep_mesh.mesh_dim_names, etp_mesh.mesh_dim_names
    if ep_mesh.ndim != 1 or etp_mesh.ndim != 1 or etp_mesh.get_root_mesh() is not root or not ep_names \
            or not etp_names or root.mesh_dim_names is None \
            or not {ep_names[0], etp_names[0]} <= set(root.mesh_dim_names):
        raise ValueError(
            "ep_etp_mesh needs two 1-D dims sliced by name from one mesh (e.g. mesh['ep'] and mesh['etp']), got "
            f"{ep_mesh} and {etp_mesh}"
        )
    return root[(ep_names[0], etp_names[0])]
