"""The schedule objects users step, and the runner that executes a plan's actions on real ranks.

``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleZeroBubble`` take this rank's one stage,
``ScheduleInterleaved1F1B`` a list of them (one per model chunk), as in
``torch.distributed.pipelining``.  ``step(*inputs, target=..., losses=[...])`` splits the inputs
(first stage) and the target (last stage) into ``n_microbatches`` equal chunks along dim 0, runs
this rank's actions of the plan, and appends each microbatch's loss to ``losses`` (last stage).
The loss of each microbatch is multiplied by ``1 / n_microbatches`` before backward
(``scale_grads``), so for a mean loss the accumulated gradients are those of the mean over the
whole batch on one process.

Transfers: activations and gradients go by asynchronous P2P on the pp group; their shapes are
exchanged on the first step and cached (a later step with other shapes is refused).  Sends are
never waited before the end of the step.  With ``overlap_p2p`` (the default) the receive of this
rank's next transfer is posted before each compute action and before each blocking wait, so its
data moves while this rank computes or waits and is there when the plan reaches it; one receive
buffer at most is held ahead.  Without it a receive is posted when the plan reaches it.  Either
way the same transfers run (same tags, same counts) and the numbers are the same.

Data parallelism inside a stage: a stage module with FSDP2's controls (``fully_shard``'s
``set_requires_gradient_sync`` and ``set_reshard_after_backward``) has both turned off for the
backward of every microbatch but its last, so its gradients accumulate locally and are reduced
once per step, and its gathered parameters are not freed between microbatches.

Failure: an exception on any rank during a step is posted on the rendezvous store; a rank
waiting for a transfer sees it within milliseconds and raises ``PipelineAbortedError`` naming
the failed rank and its error; every rank then joins one agreement so none is left waiting.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hp_pp.actions import Action, ActionKind
from hp_pp.errors import PipelineAbortedError, PipelineConfigError
from hp_pp.platform import PPPrimitives, current
from hp_pp.schedules import PipelinePlan, ScheduleKind, build_plan
from hp_pp.split import stage_rank
from hp_pp.stage import PipelineStage

_ids = itertools.count()
# P2P tags: activations and gradients below 2**28, tied gradients in [2**28, 2**29), shapes from 2**30
_TAG_META = 1 << 30
_TAG_TIED = 1 << 29
_ABORT_EVERY_S = 0.02


@dataclass
class StepStats:
    """What one ``step`` did on this rank, counted by the runner as it ran: point-to-point
    transfers of activations and gradients (``sends`` / ``recvs``), the one-time shape messages
    and the tied-gradient exchanges apart, and the most forward outputs each virtual stage held at
    once (``peak_activations``: a microbatch's output is held from its F until the B, or W, that
    frees it)."""

    sends: int = 0
    recvs: int = 0
    shape_messages: int = 0
    tied_messages: int = 0
    peak_activations: dict[int, int] = field(default_factory=dict)
    # where this rank's time went, for profiling (seconds, wall clock): forward, loss and backward
    # actions, and blocked in a wait for a transfer; the rest of the step is the bubble's other
    # causes (the end-of-step agreement waits for the slowest rank) and the runner itself
    compute_s: float = 0.0
    wait_s: float = 0.0
    # receives posted ahead of the plan position that needs them (``overlap_p2p``)
    posted_ahead: int = 0


class PipelineSchedule:
    """A schedule over this rank's ``stages``; see the module docstring."""

    kind: ScheduleKind

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        *,
        scale_grads: bool = True,
        overlap_p2p: bool = True,
    ) -> None:
        if not stages:
            raise PipelineConfigError("a schedule needs at least one PipelineStage")
        for s in stages:
            if not isinstance(s, PipelineStage):
                raise TypeError(f"stages must be PipelineStage objects, got {type(s).__name__}")
        first = stages[0]
        if any(s.num_stages != first.num_stages or s.pp_ranks != first.pp_ranks for s in stages):
            raise PipelineConfigError("every stage of one schedule must have the same num_stages and pp mesh")
        pp, nv = first.pp_size, first.num_stages
        per_rank = nv // pp
        if len(stages) != per_rank:
            raise PipelineConfigError(
                f"this rank runs {per_rank} of the {nv} stages over pp={pp}, but the schedule got {len(stages)} "
                f"stage(s); pass stages {[first.pp_rank + k * pp for k in range(per_rank)]}"
            )
        self.plan: PipelinePlan = build_plan(self.kind, pp, n_microbatches, nv)
        self._stages = {s.stage_index: s for s in stages}
        if len(self._stages) != len(stages):
            raise PipelineConfigError(f"stage indices repeat: {[s.stage_index for s in stages]}")
        if loss_fn is None and nv - 1 in self._stages:
            raise PipelineConfigError("the last stage needs a loss_fn(output, target)")
        self.loss_fn = loss_fn
        self.n_microbatches = n_microbatches
        self.scale_grads = scale_grads
        self.overlap_p2p = overlap_p2p
        self.pp, self.num_stages, self.pp_rank = pp, nv, first.pp_rank
        self.group, self.pp_ranks = first.pp_group, first.pp_ranks
        self._prims: PPPrimitives = current()
        self._id = next(_ids)
        self._step = 0
        self._shapes: dict[int, tuple[tuple[int, ...], str]] = {}  # edge v -> v+1: (shape, dtype)
        self._tied: list[tuple[str, list[int]]] | None = None
        # FSDP2's controls of each data-parallel-sharded stage module, looked up once
        self._dp_controls = {v: c for v, s in self._stages.items()
                             if (c := _grad_sync_controls(s.module)) is not None}
        if self.kind is ScheduleKind.ZERO_BUBBLE:
            for s in stages:
                if s.stage_index in self._dp_controls:
                    raise PipelineConfigError(
                        f"stage {s.stage_index}'s module is sharded with fully_shard, whose gradient reduction "
                        f"runs when a parameter's gradient is complete; ScheduleZeroBubble splits backward into "
                        f"input- and weight-gradient passes, which it does not follow yet: use Schedule1F1B or "
                        f"ScheduleInterleaved1F1B"
                    )
        self.last_step: StepStats | None = None
        self._stats = StepStats()

    # ----- public -----
    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any) -> None:
        """Run one step: forward and backward of every microbatch on this rank's stages.
        Gradients accumulate into the parameters' ``.grad`` (zero them between steps)."""
        key = f"hp_pp/{self._id}/{self._step}"
        self._step += 1
        self._stats = StepStats()
        abort = self._prims.abort_channel()
        error: BaseException | None = None
        try:
            self._run(args, kwargs, target, losses, abort, key)
            self._sync_tied(abort, key)
        except BaseException as e:  # noqa: BLE001  (re-raised below, after every rank agrees)
            error = e
            self._prims.abandon()
            if not isinstance(e, PipelineAbortedError):
                abort.post(key, f"pp rank {self.pp_rank} (global rank {self.pp_ranks[self.pp_rank]}): "
                                f"{type(e).__name__}: {e}")
        ok = self._prims.agree(error is None, self.group)
        self.last_step = self._stats
        if error is not None:
            raise error
        if not ok:
            raise PipelineAbortedError(self._abort_message(abort, key))

    def __str__(self) -> str:
        return str(self.plan)

    # ----- the runner -----
    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, losses: list[Any] | None,
             abort: Any, key: str) -> None:
        P = self._prims
        m = self.n_microbatches
        last = self.num_stages - 1
        arg_chunks: list[list[Any]] = []
        kw_chunks: list[dict[str, Any]] = [{} for _ in range(m)]
        if 0 in self._stages:
            if not args:
                raise PipelineConfigError("the first stage's step() needs the model inputs")
            arg_chunks = [self._split(a, "input") for a in args]
            for name, value in kwargs.items():
                for i, c in enumerate(self._split(value, name)):
                    kw_chunks[i][name] = c
        targets: list[Any] = []
        if last in self._stages:
            if target is None:
                raise PipelineConfigError("the last stage's step() needs target=")
            targets = self._split(target, "target")
        inputs: dict[tuple[int, int], list[Any]] = {}
        outputs: dict[tuple[int, int], Any] = {}
        arrived: dict[tuple[int, int], Any] = {}  # stage input, by (stage, mb)
        grads: dict[tuple[int, int], Any] = {}  # gradient of a stage's output, by (stage, mb)
        sent_grads: dict[tuple[int, int], Any] = {}
        weight_pending: dict[tuple[int, int], tuple[Any, Any]] = {}
        sends: list[Any] = []
        posted: dict[Action, tuple[Any, Any]] = {}
        acts = self.plan.rank_actions(self.pp_rank)
        ahead = _next_receive(acts) if self.overlap_p2p else None
        backwards = {v: 0 for v in self._stages}
        stats = self._stats
        held = dict.fromkeys(self._stages, 0)
        peak = stats.peak_activations = dict(held)
        clock = time.perf_counter
        for idx, a in enumerate(acts):
            v, mb = a.stage, a.microbatch
            k = a.kind
            if ahead is not None and k.is_compute:
                self._post_ahead(ahead[idx], acts, posted, outputs, abort, key)
            started = clock()
            if k is ActionKind.F:
                stage = self._stages[v]
                if v == 0:
                    fargs: list[Any] = [c[mb] for c in arg_chunks]
                    leaves: list[Any] = []
                    fkw = kw_chunks[mb]
                else:
                    leaf = P.as_stage_input(arrived.pop((v, mb)))
                    fargs, leaves, fkw = [leaf], [leaf], {}
                out = P.forward(stage.module, fargs, fkw)
                if not P.is_tensor(out):
                    raise TypeError(f"stage {v} returned {type(out).__name__}; a pipeline stage must return one tensor")
                if stage.check_finite and not P.all_finite(out):
                    raise FloatingPointError(f"stage {v} produced a NaN or infinity on microbatch {mb} (check_finite)")
                if v == last:
                    assert self.loss_fn is not None
                    loss = self.loss_fn(out, targets[mb])
                    if losses is not None:
                        losses.append(P.loss_value(loss))
                    out = P.scale(loss, 1.0 / m if self.scale_grads else 1.0)
                elif stage_rank(v + 1, self.pp) == self.pp_rank:
                    arrived[(v + 1, mb)] = out
                outputs[(v, mb)] = out
                inputs[(v, mb)] = leaves
                held[v] += 1
                peak[v] = max(peak[v], held[v])
                stats.compute_s += clock() - started
            elif k is ActionKind.SEND_F:
                out = outputs[(v, mb)]
                self._check_shape(v, out, sends, a.peer)
                sends.append(P.isend(out, self.pp_ranks[a.peer], self.group, self._tag(a)))  # type: ignore[index]
                stats.sends += 1
            elif k is ActionKind.RECV_F:
                arrived[(v, mb)] = self._receive(a, ahead[idx] if ahead else None, acts, posted, outputs,
                                                 abort, key)
            elif k in (ActionKind.B, ActionKind.I):
                out = outputs[(v, mb)]
                grad = grads.pop((v, mb), None) if v < last else None
                leaves = inputs[(v, mb)]
                self._before_backward(v, last_one=backwards[v] == m - 1)
                backwards[v] += 1
                if k is ActionKind.B:
                    in_grads = P.backward(out, grad, leaves)
                    del outputs[(v, mb)], inputs[(v, mb)]
                    held[v] -= 1
                else:
                    in_grads = P.backward_input(out, grad, leaves)
                    weight_pending[(v, mb)] = (out, grad)
                if v > 0:
                    g = in_grads[0]
                    if g is None:
                        raise RuntimeError(f"stage {v}'s input got no gradient on microbatch {mb}: the stage's output "
                                           f"does not depend on its input")
                    if stage_rank(v - 1, self.pp) == self.pp_rank:
                        grads[(v - 1, mb)] = g
                    else:
                        sent_grads[(v, mb)] = g
                stats.compute_s += clock() - started
            elif k is ActionKind.W:
                out, grad = weight_pending.pop((v, mb))
                P.backward_weight(out, grad, P.trainable_params(self._stages[v].module))
                del outputs[(v, mb)], inputs[(v, mb)]
                held[v] -= 1
                stats.compute_s += clock() - started
            elif k is ActionKind.SEND_B:
                sends.append(P.isend(sent_grads.pop((v, mb)), self.pp_ranks[a.peer], self.group,  # type: ignore[index]
                                     self._tag(a)))
                stats.sends += 1
            elif k is ActionKind.RECV_B:
                grads[(v, mb)] = self._receive(a, ahead[idx] if ahead else None, acts, posted, outputs,
                                               abort, key)
        for h in sends:
            self._wait(h, abort, key)

    def _before_backward(self, v: int, *, last_one: bool) -> None:
        """A data-parallel-sharded stage (a module with FSDP2's controls) reduces its gradients
        once per step, in the backward of its last microbatch; before it, they accumulate locally
        and the gathered parameters stay gathered for the next microbatch."""
        controls = self._dp_controls.get(v)
        if controls is not None:
            sync, reshard = controls
            sync(last_one)
            reshard(last_one)

    def _split(self, value: Any, what: str) -> list[Any]:
        m = self.n_microbatches
        P = self._prims
        if not P.is_tensor(value):
            return [value] * m
        rows = P.describe(value)[0][0] if P.describe(value)[0] else 0
        if rows % m:
            raise PipelineConfigError(
                f"the {what} has {rows} rows along dim 0, which do not split into n_microbatches={m} equal "
                f"microbatches; pass a batch that is a multiple of {m}"
            )
        return P.split(value, m)

    def _tag(self, a: Action) -> int:
        direction = 0 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_F) else 1
        # the stage whose output or input gradient moves, whichever end names it
        stage = a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage + 1 if a.kind is ActionKind.RECV_B else a.stage
        unit = (stage * self.n_microbatches + a.microbatch) * 2 + direction
        return (self._epoch() * 2 * self.num_stages * self.n_microbatches + unit) % (_TAG_TIED // 2)

    def _epoch(self) -> int:
        """This schedule's current step, unique among recent schedules and steps: a transfer left
        pending by a failed step can never match a later step's."""
        return (self._id % 4096) * 4096 + (self._step - 1) % 4096

    def _check_shape(self, v: int, out: Any, sends: list[Any], peer: int | None) -> None:
        P = self._prims
        desc = P.describe(out)
        known = self._shapes.get(v)
        if known is None:
            self._shapes[v] = desc
            assert peer is not None
            tag = _TAG_META + (self._epoch() * self.num_stages + v) % _TAG_TIED
            sends.append(P.send_shape(desc[0], desc[1], self.pp_ranks[peer], self.group, tag))
            self._stats.shape_messages += 1
        elif known != desc:
            raise PipelineConfigError(
                f"stage {v}'s output is {desc[1]} {list(desc[0])} but was {known[1]} {list(known[0])} on earlier "
                f"microbatches or steps; every microbatch must have the same shape (build a new schedule for new shapes)"
            )

    def _receive(self, a: Action, following: int | None, acts: Sequence[Action],
                 posted: dict[Action, tuple[Any, Any]], outputs: dict[tuple[int, int], Any],
                 abort: Any, key: str) -> Any:
        if a not in posted:
            posted[a] = self._post(a, outputs, abort, key)
        buf, handle = posted.pop(a)
        # the next receive's data can move while this one is waited for
        self._post_ahead(following, acts, posted, outputs, abort, key)
        self._wait(handle, abort, key)
        return buf

    def _post_ahead(self, idx: int | None, acts: Sequence[Action], posted: dict[Action, tuple[Any, Any]],
                    outputs: dict[tuple[int, int], Any], abort: Any, key: str) -> None:
        """Post the receive at ``idx`` of this rank's actions now, when its buffer's shape is
        known without waiting (an activation's once shapes are cached, a gradient's once the
        forward it belongs to has run)."""
        if idx is None:
            return
        a = acts[idx]
        if a not in posted and self._shape_known(a, outputs):
            posted[a] = self._post(a, outputs, abort, key)
            self._stats.posted_ahead += 1

    def _shape_known(self, a: Action, outputs: dict[tuple[int, int], Any]) -> bool:
        if a.kind is ActionKind.RECV_F:
            return (a.stage - 1) in self._shapes
        return (a.stage, a.microbatch) in outputs

    def _post(self, a: Action, outputs: dict[tuple[int, int], Any], abort: Any, key: str) -> tuple[Any, Any]:
        P = self._prims
        assert a.peer is not None
        peer = self.pp_ranks[a.peer]
        if a.kind is ActionKind.RECV_F:
            edge = a.stage - 1
            if edge not in self._shapes:
                tag = _TAG_META + (self._epoch() * self.num_stages + edge) % _TAG_TIED
                meta, h, decode = P.recv_shape(peer, self.group, tag)
                self._stats.shape_messages += 1
                self._wait(h, abort, key)
                self._shapes[edge] = decode(meta)
            shape, dtype = self._shapes[edge]
        else:
            shape, dtype = P.describe(outputs[(a.stage, a.microbatch)])
        self._stats.recvs += 1
        return P.irecv(shape, dtype, peer, self.group, self._tag(a))

    def _wait(self, handle: Any, abort: Any, key: str) -> None:
        started = time.perf_counter()
        done = self._prims.watch(handle)
        while not done.wait(_ABORT_EVERY_S):
            if abort.read(key) is not None:
                raise PipelineAbortedError(self._abort_message(abort, key))
        self._stats.wait_s += time.perf_counter() - started
        done.result()

    def _abort_message(self, abort: Any, key: str) -> str:
        origin = abort.read(key) or "another rank of the pipeline failed"
        return f"pipeline step stopped on pp rank {self.pp_rank}: {origin}"

    # ----- tied parameters -----
    def _sync_tied(self, abort: Any, key: str) -> None:
        """Every copy of a tied parameter gets the sum of the copies' gradients (summed in pp-rank
        order on every holder, so the copies stay bitwise equal)."""
        P = self._prims
        if self._tied is None:
            mine = sorted({name for s in self._stages.values() for name in s.tied_parameters})
            everyone = P.all_gather_object(mine, self.group)
            holders: dict[str, list[int]] = {}
            for r, names in enumerate(everyone):
                for n in names:
                    holders.setdefault(n, []).append(r)
            self._tied = [(n, rs) for n, rs in sorted(holders.items()) if self.pp_rank in rs]
        for i, (name, ranks) in enumerate(self._tied):
            params: list[Any] = []
            for s in self._stages.values():
                p = s.tied_parameters.get(name)
                if p is not None and all(p is not q for q in params):
                    params.append(p)
            if len(ranks) == 1 and len(params) == 1:
                continue  # one copy: its gradient is already the sum
            local = [P.local_grad(p) for p in params]
            if any(g is None for g in local):
                raise RuntimeError(f"tied parameter {name!r} has no gradient on pp rank {self.pp_rank} after backward")
            mine = P.zeros_like(local[0])
            for g in local:
                P.add_(mine, g)
            bufs: dict[int, Any] = {}
            handles = []
            shape, dtype = P.describe(mine)
            for r in ranks:
                if r != self.pp_rank:
                    tag = _TAG_TIED // 2 + (self._epoch() * 64 + i) % (_TAG_TIED // 2)
                    handles.append(P.isend(mine, self.pp_ranks[r], self.group, tag, kind="send_tied"))
                    bufs[r], h = P.irecv(shape, dtype, self.pp_ranks[r], self.group, tag, kind="recv_tied")
                    handles.append(h)
                    self._stats.tied_messages += 2
            for h in handles:
                self._wait(h, abort, key)
            total = P.zeros_like(mine)
            for r in ranks:
                P.add_(total, mine if r == self.pp_rank else bufs[r])
            for g in local:
                P.copy_(g, total)


def _next_receive(acts: Sequence[Action]) -> list[int | None]:
    """For each position of ``acts``: the position of the first receive after it, or None."""
    out: list[int | None] = [None] * len(acts)
    nxt: int | None = None
    for i in range(len(acts) - 1, -1, -1):
        out[i] = nxt
        if acts[i].kind.is_recv:
            nxt = i
    return out


def _grad_sync_controls(module: Any) -> tuple[Callable[[bool], None], Callable[[bool], None]] | None:
    """FSDP2's ``set_requires_gradient_sync`` and ``set_reshard_after_backward`` of ``module``,
    when it has them (a ``fully_shard`` module of any backend), else None."""
    sync = getattr(module, "set_requires_gradient_sync", None)
    reshard = getattr(module, "set_reshard_after_backward", None)
    if callable(sync) and callable(reshard):
        return sync, reshard
    return None


class ScheduleGPipe(PipelineSchedule):
    """All forwards, then all backwards: every microbatch's activations are held at once."""

    kind = ScheduleKind.GPIPE

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable[[Any, Any], Any] | None = None,
                 **kw: Any) -> None:
        super().__init__([stage], n_microbatches, loss_fn, **kw)


class Schedule1F1B(PipelineSchedule):
    """One forward, one backward: rank ``r`` holds at most ``pp - r`` microbatches' activations."""

    kind = ScheduleKind.ONE_F_ONE_B

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable[[Any, Any], Any] | None = None,
                 **kw: Any) -> None:
        super().__init__([stage], n_microbatches, loss_fn, **kw)


class ScheduleZeroBubble(PipelineSchedule):
    """1F1B with each backward split into the input gradient (sent on at once) and the weight
    gradient (deferred into the idle time at the end of the step): ZB-H1."""

    kind = ScheduleKind.ZERO_BUBBLE

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable[[Any, Any], Any] | None = None,
                 **kw: Any) -> None:
        super().__init__([stage], n_microbatches, loss_fn, **kw)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Several model chunks per rank (``stages``, one per chunk): the interleaved 1F1B schedule;
    ``n_microbatches`` must be a multiple of pp."""

    kind = ScheduleKind.INTERLEAVED_1F1B
