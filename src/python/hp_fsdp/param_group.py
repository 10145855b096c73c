"""``FSDPParamGroup``: the parameters of one ``fully_shard`` call, gathered by one all_gather and
reduced by one reduce_scatter (plus one all_reduce across replicas under HSDP).

States: SHARDED (modules hold the sharded parameters, the unsharded storage is freed),
UNSHARDED (modules hold the unsharded parameters) and, between forward and backward of a group
with ``reshard_after_forward=<int>``, SHARDED_POST_FORWARD: the modules hold the sharded
parameters and this rank keeps ``1/int`` of the gathered buffer, which backward gathers back
over a group of ``int`` ranks instead of the whole shard group.  An all_gather may be in flight
towards UNSHARDED (a prefetch); ``wait_unshard`` finishes it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from hp_dtensor.platform import current as _platform
from hp_fsdp.mesh_info import FSDPMeshInfo, PostForwardGroup
from hp_fsdp.param import FSDPParam
from hp_fsdp.policy import MixedPrecisionPolicy
from hp_fsdp.primitives import FSDPPrimitives, Pending, Tensor


def prims_grad(prims: FSDPPrimitives, param: Tensor | None) -> Tensor | None:
    return None if param is None else prims.get_grad(param)


class GroupState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDED = "unsharded"


class FSDPParamGroup:
    def __init__(
        self, prims: FSDPPrimitives, params: Sequence[FSDPParam], info: FSDPMeshInfo, mp: MixedPrecisionPolicy,
        compute_device: object, offloaded: bool,
    ) -> None:
        self.prims = prims
        self.params = list(params)
        self.needs_grad = [p for p in self.params if p.requires_grad]  # whose gradients are reduced
        self.info = info
        self.mp = mp
        self.compute_device = compute_device
        self.offloaded = offloaded
        dtypes = {p.orig_dtype for p in self.params}
        if mp.param_dtype is None and len(dtypes) > 1:
            names = {str(p.orig_dtype): p.fqn for p in self.params}
            raise ValueError(
                f"fully_shard gathers a group's parameters in one buffer, so they need one dtype; found {names}; "
                f"set MixedPrecisionPolicy(param_dtype=...) or fully_shard the submodules separately"
            )
        self.param_dtype: object = mp.param_dtype if mp.param_dtype is not None else next(iter(dtypes))
        self.reduce_dtype: object = mp.reduce_dtype if mp.reduce_dtype is not None else self.param_dtype
        self.state = GroupState.SHARDED
        self._pending: Pending | None = None
        self.reduce_grads = True
        self.divide_factor: float | None = None  # None: average over every data-parallel rank
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        # reshard_after_forward=<int>: the smaller group to keep the parameters in after forward
        self.post_forward_group: PostForwardGroup | None = None
        # SHARDED_POST_FORWARD: this rank's part of the gathered buffer and the group it came from
        self._post_forward: tuple[PostForwardGroup, Tensor] | None = None
        # UNSHARDED, gathered in forward: this rank's part, kept for the reshard after forward
        self._post_forward_part: Tensor | None = None
        self.grads_ready = 0
        self.in_backward = False
        self._pending_reduce: Pending | None = None
        # Groups whose reduce_scatter is in flight, shared by every group under one root.
        self.reduce_queue: list[FSDPParamGroup] = []
        # Autograd-gather backends, gradient sync off: the unsharded gradients summed so far.
        self._unsynced: list[Tensor] | None = None


    # ----- unshard / reshard -----
    def unshard(self, *, async_op: bool = False) -> None:
        """Start gathering the group's parameters (nothing to do when gathered or in flight)."""
        if self.state is GroupState.UNSHARDED or self._pending is not None:
            return
        if self._post_forward is not None:  # the smaller group holds every row between its ranks
            pf, part = self._post_forward
            self._pending = self.prims.all_gather_start(part, pf.group, pf.size, async_op=async_op)
            return
        shards = [self.prims.local_of(p.sharded_param) for p in self.params]
        if self.offloaded:
            shards = [self.prims.to_device(s, self.compute_device) for s in shards]
        flat = self.prims.gather_copy_in(shards, [p.chunk_rows for p in self.params], self.param_dtype)
        self._pending = self.prims.all_gather_start(
            flat, self.info.shard_group, self.info.shard_size, async_op=async_op
        )

    def wait_unshard(self) -> None:
        """Make the unsharded parameters current in their modules."""
        if self.state is GroupState.UNSHARDED:
            return
        if self._pending is None:
            self.unshard()
        assert self._pending is not None
        gathered = self._pending.wait()
        self._pending = None
        self._post_forward = None  # gathered back (when it was set): its part is in the buffer now
        if self.post_forward_group is not None and self.reshard_after_forward and not self.in_backward:
            # gathered for forward: keep this rank's part for the reshard after it
            self._post_forward_part = self._part_of(gathered, self.post_forward_group)
        if self.prims.autograd_gather:
            self._bind_gathered(gathered)
            self.state = GroupState.UNSHARDED
            return
        for p in self.params:
            self._alloc_unsharded(p)
        self.prims.gather_copy_out(
            gathered, self.info.shard_size, [p.chunk_rows for p in self.params],
            [p.unsharded_local for p in self.params],
        )
        for p in self.params:
            self._swap(p, p.unsharded_param)
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Put the sharded parameters back and free the unsharded storage."""
        if self._pending is not None:  # a prefetch nobody used: finish it so ranks stay in step
            self._pending.wait()
            self._pending = None
        self._post_forward = None
        self._post_forward_part = None
        if self.state is GroupState.UNSHARDED:
            self._free_unsharded()
        self.state = GroupState.SHARDED

    def post_forward(self) -> None:
        """After the module's forward: reshard when ``reshard_after_forward`` says so -- to this
        rank's part of a smaller group when it is an int."""
        if self.prims.autograd_gather:
            # The gathered values belong to this forward's graph (which keeps them alive until its
            # backward): the next forward gathers afresh, whatever reshard_after_forward says.
            self.reshard()
            return
        if not self.reshard_after_forward:
            return
        pf, part = self.post_forward_group, self._post_forward_part
        if pf is None or part is None or self.state is not GroupState.UNSHARDED or self._pending is not None:
            self.reshard()
            return
        self._post_forward_part = None
        self._free_unsharded()
        self._post_forward = (pf, part)
        self.state = GroupState.SHARDED_POST_FORWARD

    def _part_of(self, gathered: Tensor, pf: PostForwardGroup) -> Tensor:
        """A copy of the contributions of shard ranks ``[index * n/size, (index+1) * n/size)`` of
        the rank-major gathered buffer: what the ranks of ``pf`` gather back, in their order,
        into the whole buffer."""
        length = self.prims.shape_of(gathered)[0] // pf.size
        return self.prims.rows(gathered, pf.index * length, length)

    def _free_unsharded(self) -> None:
        if self.prims.autograd_gather:  # the modules' own (sharded) parameters show through again
            for p in self.params:
                for owner, name in p.owners:
                    self.prims.bind_value(owner, name, None)
                p.unsharded_param = None
            return
        for p in self.params:
            self._swap(p, p.sharded_param)
            self.prims.free_storage(p.unsharded_local)

    def adopt_converted_params(self) -> None:
        """Take the sharded parameters the owning modules hold now (a module-wide conversion may
        have replaced them or their data) and drop the unsharded buffers built for the old ones."""
        prims = self.prims
        for p in self.params:
            owner, name = p.owners[0]
            current = getattr(owner, name)
            for other, other_name in p.owners[1:]:  # tied owners keep one parameter
                _platform().share_param(other, other_name, current)
            p.sharded_param = current
            p.orig_dtype = prims.dtype_of(current)
            p.unsharded_param = None
            p.unsharded_local = None
        if self.params:
            self.compute_device = prims.device_of(prims.local_of(self.params[0].sharded_param))
            if self.mp.param_dtype is None:
                self.param_dtype = self.params[0].orig_dtype
            if self.mp.reduce_dtype is None:
                self.reduce_dtype = self.param_dtype

    def _bind_gathered(self, gathered: Tensor) -> None:
        """Autograd-gather backends: make this forward's unsharded values (outputs of one
        differentiable gather whose backward is ``_reduce_in_backward``) and show them to the
        modules in place of their sharded parameters."""
        prims, n = self.prims, self.info.shard_size
        chunk_rows = [p.chunk_rows for p in self.params]
        shapes = [p.unsharded_shape for p in self.params]
        values = prims.gather_in_autograd(
            [p.sharded_param for p in self.params], gathered, n, chunk_rows, shapes, self._reduce_in_backward,
        )
        for p, value in zip(self.params, values):
            if p.tp_mesh is not None:
                value = prims.wrap(value, p.tp_mesh, p.tp_placements, p.global_shape)
            p.unsharded_param = value
            for owner, name in p.owners:
                prims.bind_value(owner, name, value)

    def _reduce_in_backward(self, grads: list[Tensor | None]) -> list[Tensor]:
        """The gradients of the sharded parameters from those of the unsharded values (one per
        parameter of the group, in order): one reduce_scatter (and the replicas' all_reduce),
        divided as ``finish_reduce`` divides.  With gradient sync off, the unsharded gradients are
        kept and summed into the next synced backward's; the sharded ones are zero meanwhile."""
        prims, n = self.prims, self.info.shard_size
        locals_: list[Tensor] = []
        for p, g in zip(self.params, grads):
            if g is None:
                g = prims.zeros(p.unsharded_shape, self.reduce_dtype, self.compute_device)
            locals_.append(g)
        if self._unsynced is not None:
            for acc, g in zip(self._unsynced, locals_):
                prims.add_(acc, g)
            locals_ = self._unsynced
        elif not self.reduce_grads:  # the first unsynced backward: own the sums
            locals_ = [prims.rows(g, 0, prims.shape_of(g)[0]) for g in locals_]
        if not self.reduce_grads:
            self._unsynced = locals_
            return [prims.zeros(p.shard_shape, p.orig_dtype, self.compute_device) for p in self.params]
        self._unsynced = None
        flat = prims.scatter_copy_in(locals_, n, [p.chunk_rows for p in self.params], self.reduce_dtype)
        out = prims.reduce_scatter_start(flat, self.info.shard_group, n).wait()
        if self.info.is_hybrid:
            out = prims.all_reduce_sum(out, self.info.replicate_group, self.info.replicate_size)
        factor = self.divide_factor if self.divide_factor is not None else float(self.info.dp_size)
        return prims.scatter_copy_out(
            out, [p.chunk_rows for p in self.params], [p.shard_shape for p in self.params],
            [p.orig_dtype for p in self.params], 1.0 / factor,
        )

    def _alloc_unsharded(self, p: FSDPParam) -> None:
        if p.unsharded_local is not None:
            self.prims.alloc_storage(p.unsharded_local)
            return
        local = self.prims.empty(p.unsharded_shape, self.param_dtype, self.compute_device)
        if p.tp_mesh is not None:
            value = self.prims.wrap(local, p.tp_mesh, p.tp_placements, p.global_shape)
        else:
            value = local
        param = self.prims.new_param(value, p.requires_grad)
        p.unsharded_param = param
        # The tensor whose storage is freed and refilled: the one the parameter itself views.
        p.unsharded_local = self.prims.local_of(param)
        if p.requires_grad:
            self.prims.register_post_accumulate_grad_hook(param, self._on_grad)

    def _swap(self, p: FSDPParam, value: Tensor) -> None:
        plat = _platform()
        for module, name in p.owners:
            plat.share_param(module, name, value)

    # ----- gradients -----
    def pre_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.grads_ready = 0
        self.wait_unshard()

    def _on_grad(self) -> None:
        self.grads_ready += 1
        if self.in_backward and self.grads_ready == len(self.needs_grad):
            self.post_backward()

    def post_backward(self) -> None:
        """Start reducing the unsharded gradients into the sharded parameters' ``.grad`` (unless
        gradient sync is off: they then accumulate unsharded until a step that syncs), then
        reshard (unless ``reshard_after_backward`` is off).  The reduce_scatter runs while
        backward goes on; ``finish_reduce`` completes it (the root calls it when the next group
        starts one, and at the end of backward)."""
        self.in_backward = False
        if self.reduce_grads:
            self._start_reduce()
            queue = self.reduce_queue
            queue.append(self)
            while len(queue) > 1:  # one reduction in flight at a time bounds the memory it holds
                queue.pop(0).finish_reduce()
        if self.reshard_after_backward:
            self.reshard()

    def _start_reduce(self) -> None:
        params = self.needs_grad
        grads = [prims_grad(self.prims, p.unsharded_param) for p in params]
        if all(g is None for g in grads):
            return
        prims = self.prims
        locals_: list[Tensor] = []
        for p, g in zip(params, grads):
            if g is None:  # unused this step on this rank: contributes zeros so ranks stay in step
                g = prims.zeros(p.unsharded_shape, self.reduce_dtype, self.compute_device)
            elif p.tp_mesh is not None and prims.is_dtensor(g):
                if tuple(g.placements) != p.tp_placements:
                    g = g.redistribute(p.tp_mesh, p.tp_placements)
                g = prims.local_of(g)
            locals_.append(g)
        n = self.info.shard_size
        flat = prims.scatter_copy_in(locals_, n, [p.chunk_rows for p in params], self.reduce_dtype)
        for p in params:  # the unsharded gradients are in the buffer now: free them
            if p.unsharded_param is not None:
                prims.set_grad(p.unsharded_param, None)
        self._pending_reduce = prims.reduce_scatter_start(flat, self.info.shard_group, n)

    def finish_reduce(self) -> None:
        """Wait for this group's reduce_scatter, all_reduce across replicas (HSDP), divide and
        accumulate into the sharded gradients."""
        pending, self._pending_reduce = self._pending_reduce, None
        if pending is None:
            return
        prims = self.prims
        params = self.needs_grad
        out = pending.wait()
        if self.info.is_hybrid:
            out = prims.all_reduce_sum(out, self.info.replicate_group, self.info.replicate_size)
        factor = self.divide_factor if self.divide_factor is not None else float(self.info.dp_size)
        shards = prims.scatter_copy_out(
            out, [p.chunk_rows for p in params], [p.shard_shape for p in params],
            [p.orig_dtype for p in params], 1.0 / factor,
        )
        for p, shard in zip(params, shards):
            sharded = p.sharded_param
            if self.offloaded:
                shard = prims.to_device(shard, prims.device_of(prims.local_of(sharded)))
            existing = prims.get_grad(sharded)
            if existing is None:
                mesh, placements = sharded.device_mesh, tuple(sharded.placements)
                prims.set_grad(sharded, prims.wrap(shard, mesh, placements, p.global_shape))
            else:  # gradients accumulate across backward passes, as on an unsharded module
                prims.add_(prims.local_of(existing), shard)
