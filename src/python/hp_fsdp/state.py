"""``FSDPState``: the hooks of one ``fully_shard`` module, and the root's view of all of them.

The outermost sharded module that runs forward first becomes the root.  The root keeps the order
in which sharded modules started their forward; from the second step on, each module's forward
starts the all_gather of the next one (forward prefetch).  Backward runs the modules in the
reverse of the order in which their forwards *finished* (a module wrapping others, like a root
whose last layer follows the blocks, finishes after them), so each forward that finishes is
recorded, and a module's backward starts the all_gather of the module that finished just before
it (backward prefetch), so the gather overlaps compute.  Prefetching by start order instead
would gather a root whose backward already ran (its head's gradients come first) once more.
After backward, the root reduces what the per-parameter gradient hooks did not (parameters
without a gradient) and reshards everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hp_dtensor.platform import current as _platform
from hp_fsdp.param_group import FSDPParamGroup, GroupState
from hp_fsdp.policy import MixedPrecisionPolicy
from hp_fsdp.primitives import FSDPPrimitives


@dataclass
class RootContext:
    """Shared by every state under one root."""

    states: list[FSDPState]
    forward_order: list[FSDPState] = field(default_factory=list)
    # This step's finished forwards, one entry per call (a module called twice is there twice).
    post_forward_order: list[FSDPState] = field(default_factory=list)
    reduce_queue: list[FSDPParamGroup] = field(default_factory=list)
    order_frozen: bool = False
    backward_queued: bool = False


class FSDPState:
    def __init__(self, prims: FSDPPrimitives, module: object, group: FSDPParamGroup | None,
                 mp: MixedPrecisionPolicy, *, auto_reshard: bool = True) -> None:
        self.prims = prims
        self.module = module
        self.group = group
        self.mp = mp
        self.auto_reshard = auto_reshard  # reshard_after_forward left to fully_shard: all but the root
        self.ctx: RootContext | None = None
        self.is_root: bool | None = None
        self._pre_backward_done = False
        # Positions of this module's finished forwards in ``ctx.post_forward_order`` (this step).
        self._post_forward_indices: list[int] = []
        plat = _platform()
        plat.register_forward_pre_hook(module, self._pre_forward, with_kwargs=True)
        plat.register_forward_hook(module, self._post_forward)

    # ----- root -----
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        plat = _platform()
        states: list[FSDPState] = []
        for _name, sub in plat.named_modules(self.module):
            st = getattr(sub, "_hp_fsdp_state", None)
            if isinstance(st, FSDPState):
                states.append(st)
        ctx = RootContext(states)
        for st in states:
            st.is_root = st is self
            st.ctx = ctx
            if st.group is not None:
                st.group.reduce_queue = ctx.reduce_queue
        # The root's parameters are needed again as soon as backward starts: keep them gathered.
        if self.group is not None and self.auto_reshard:
            self.group.reshard_after_forward = False

    # ----- forward -----
    def _pre_forward(self, module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self._lazy_init()
        ctx = self.ctx
        assert ctx is not None
        if self.is_root:
            ctx.backward_queued = False
            if ctx.forward_order and not ctx.order_frozen:
                ctx.order_frozen = True
            _clear_post_forward_order(ctx)
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = self.prims.cast_floating((args, kwargs), self.mp.param_dtype)
        self._pre_backward_done = False
        if self.group is not None:
            self.group.wait_unshard()
            if not ctx.order_frozen:
                ctx.forward_order.append(self)
            else:
                nxt = _neighbour(ctx.forward_order, self, +1)
                if nxt is not None and nxt.group is not None:
                    nxt.group.unshard(async_op=True)
        return args, kwargs

    def _post_forward(self, module: object, args: tuple[Any, ...], output: Any) -> Any:
        grad = self.prims.grad_enabled()
        if self.group is not None:
            self.group.post_forward()
        if grad and self.ctx is not None and not self.ctx.backward_queued:
            # not a recomputation inside backward (activation checkpointing): a real forward
            self._post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)
        if grad:
            self.prims.register_pre_backward_hook(output, self._pre_backward)
        elif self.is_root and self.ctx is not None:
            # No backward will follow: nothing needs the gathered parameters any more.
            for st in self.ctx.states:
                if st.group is not None:
                    st.group.reshard()
        if self.mp.output_dtype is not None:
            output = self.prims.cast_floating(output, self.mp.output_dtype)
        return output

    # ----- backward -----
    def _pre_backward(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        if not ctx.backward_queued:
            ctx.backward_queued = True
            self.prims.queue_end_of_backward(_finalizer(ctx))
        if self._pre_backward_done:
            return
        self._pre_backward_done = True
        if self.group is not None:
            self.group.pre_backward()
            prev = self._backward_prefetch_target(ctx)
            if prev is not None and prev.group is not None and prev.group.state is not GroupState.UNSHARDED:
                prev.group.unshard(async_op=True)

    def _backward_prefetch_target(self, ctx: RootContext) -> FSDPState | None:
        """The module whose backward comes next: the one whose forward finished just before this
        module's (latest) forward did."""
        if not self._post_forward_indices:
            return None
        i = self._post_forward_indices.pop()
        return ctx.post_forward_order[i - 1] if i > 0 else None


def _neighbour(order: list[FSDPState], st: FSDPState, step: int) -> FSDPState | None:
    try:
        i = order.index(st) + step
    except ValueError:
        return None
    return order[i] if 0 <= i < len(order) else None


def _clear_post_forward_order(ctx: RootContext) -> None:
    ctx.post_forward_order.clear()
    for st in ctx.states:
        st._post_forward_indices.clear()


def _finalizer(ctx: RootContext) -> Any:
    def finish() -> None:
        for st in ctx.states:
            st._pre_backward_done = False
            g = st.group
            if g is None:
                continue
            if g.in_backward:
                g.post_backward()
            if g.reshard_after_backward:
                g.reshard()
        while ctx.reduce_queue:
            ctx.reduce_queue.pop(0).finish_reduce()
        _clear_post_forward_order(ctx)
        ctx.backward_queued = False
    return finish
