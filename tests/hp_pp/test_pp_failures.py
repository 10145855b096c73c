# mypy: disable-error-code="no-untyped-def,arg-type,index,union-attr,attr-defined"
"""Bad input and failures on 2 gloo ranks: one clear error on every rank, never a hang.

A stage that raises mid-step (user code, a NaN guard, a batch that does not split, a shape that
changes) raises its own error on its rank and ``PipelineAbortedError`` naming it on the other,
within the case's timeout; construction errors (a stage on the wrong rank, microbatches that the
interleaved schedule cannot take, stages that pp does not divide) raise the same
``PipelineConfigError`` on every rank before anything is sent.  After all of them the ranks still
run a correct step.
"""

from __future__ import annotations

import time

import pytest

from hp_dtensor.testing import rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=60)
D = 8


def _mesh():
    from hp_dtensor import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))


class _Block:
    """A linear stage that can be told to raise on one microbatch or return a tuple."""

    @staticmethod
    def make(raise_at: int | None = None, as_tuple: bool = False):
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.lin = torch.nn.Linear(D, D)
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                if raise_at is not None and self.calls == raise_at + 1:
                    raise ValueError(f"boom in user code at call {self.calls}")
                y = self.lin(x)
                return (y, y) if as_tuple else y

        return Block()


def _loss(out, tgt):
    return ((out - tgt) ** 2).mean()


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - start)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - start)


def _step_case(rank: int, world: int, case: str):
    import torch

    from hp_pp import PipelineStage, Schedule1F1B

    mesh = _mesh()
    raise_at = 2 if case == "user_raises" and rank == 1 else None
    block = _Block.make(raise_at=raise_at, as_tuple=case == "tuple" and rank == 0)
    stage = PipelineStage(block, rank, 2, mesh, check_finite=case == "nan")
    sched = Schedule1F1B(stage, 4, _loss)
    x = torch.randn(8, D)
    if case == "nan":
        x[3, 0] = float("nan")
    if case == "rows":
        x = torch.randn(7, D)
    tgt = torch.randn(8, D)

    def run():
        if case == "shape_change":
            sched.step(*([x] if rank == 0 else []), target=tgt if rank == 1 else None)
            # 4 rows: microbatches of 1 row where the first step sent 2
            sched.step(*([x[:4]] if rank == 0 else []), target=tgt[:4] if rank == 1 else None)
            return
        target = None if case == "no_target" else tgt
        sched.step(*([x] if rank == 0 else []), target=target if rank == 1 else None)

    return _outcome(run)


# case -> (error on the failing rank, failing rank)
STEP_CASES = {
    "user_raises": ("ValueError", 1),
    "nan": ("FloatingPointError", 0),
    "rows": ("PipelineConfigError", 0),
    "tuple": ("TypeError", 0),
    "no_target": ("PipelineConfigError", 1),
    "shape_change": ("PipelineConfigError", 0),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_failure_reaches_every_rank(pool2, case):
    err, bad = STEP_CASES[case]
    got = pool2.run(_step_case, case, timeout=30)
    other = 1 - bad
    assert got[bad][0] == err, got
    assert got[other][0] == "PipelineAbortedError", got
    assert f"pp rank {bad}" in got[other][1] and err in got[other][1], got[other][1]
    print(f"[failure] {case}: rank {bad} {err}, rank {other} aborted after {got[other][2]:.2f}s: {got[other][1][:120]}")


def _construct_case(rank: int, world: int, case: str):
    from hp_pp import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    mesh = _mesh()

    def build():
        if case == "wrong_rank":
            PipelineStage(_Block.make(), 1 - rank, 2, mesh)
        elif case == "interleaved_microbatches":
            stages = [PipelineStage(_Block.make(), rank + 2 * k, 4, mesh) for k in range(2)]
            ScheduleInterleaved1F1B(stages, 3, _loss)
        elif case == "stages_not_multiple":
            PipelineStage(_Block.make(), rank, 3, mesh)
        elif case == "missing_chunk":
            Schedule1F1B(PipelineStage(_Block.make(), rank, 4, mesh), 4, _loss)
        elif case == "no_loss_fn":
            Schedule1F1B(PipelineStage(_Block.make(), rank, 2, mesh), 4, None)
        elif case == "pp_not_dividing_world":
            from hp_dtensor import init_device_mesh

            init_device_mesh("cpu", (3,), mesh_dim_names=("pp",))
        elif case == "no_pp_dim":
            from hp_dtensor import init_device_mesh

            PipelineStage(_Block.make(), 0, 1, init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")))

    return _outcome(build)


CONSTRUCT_CASES = {
    "wrong_rank": ("PipelineConfigError", "runs on pp rank"),
    "interleaved_microbatches": ("PipelineConfigError", "n_microbatches divisible by pp"),
    "stages_not_multiple": ("PipelineConfigError", "not a multiple of the pp size"),
    "missing_chunk": ("PipelineConfigError", "pass stages"),
    "no_pp_dim": ("PipelineConfigError", "no 'pp' dim"),
    "pp_not_dividing_world": ("ValueError", "needs 3 ranks but the world has 2"),
}


@pytest.mark.parametrize("case", list(CONSTRUCT_CASES))
def test_bad_construction_same_error_everywhere(pool2, case):
    err, text = CONSTRUCT_CASES[case]
    got = pool2.run(_construct_case, case, timeout=30)
    assert [g[0] for g in got] == [err, err], got
    assert all(text in g[1] for g in got), got
    # the message is the same on every rank except for the rank numbers it names
    print(f"[construct] {case}: {got[0][0]}: {got[0][1][:120]}")


def _good_step(rank: int, world: int):
    import torch

    from hp_pp import PipelineStage, Schedule1F1B

    stage = PipelineStage(_Block.make(), rank, 2, _mesh())
    sched = Schedule1F1B(stage, 4, _loss)
    torch.manual_seed(1)
    x, tgt = torch.randn(8, D), torch.randn(8, D)
    losses: list = []
    sched.step(*([x] if rank == 0 else []), target=tgt if rank == 1 else None, losses=losses)
    # one process on the same two linear layers
    torch.manual_seed(0)
    a = torch.nn.Linear(D, D)
    torch.manual_seed(0)
    b = torch.nn.Linear(D, D)
    loss = _loss(b(a(x)), tgt)
    loss.backward()
    ref = a if rank == 0 else b
    torch.testing.assert_close(stage.module.lin.weight.grad, ref.weight.grad, rtol=1.5e-4, atol=1e-5)
    if rank == 1:
        torch.testing.assert_close(sum(losses) / 4, loss.detach(), rtol=1.5e-4, atol=1e-5)
    return True


def test_ranks_still_work_after_failures(pool2):
    assert pool2.run(_good_step) == [True, True]
