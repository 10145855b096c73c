# mypy: disable-error-code="no-untyped-def,index"
"""Gradient clipping by the global norm across every mesh dim: on 4 gloo ranks as tp=2 x
dp_shard=2 and as pp=2 x tp=2, the trainer's gradients after clipping (first step), its reported
gradient norms and its losses (with the learning-rate schedule) equal plain torch on one process
with ``torch.nn.utils.clip_grad_norm_``, while clipping is active.  Under context parallelism
(cp=2 x dp_shard=2: parameters sharded over the 4 fsdp ranks, each CP rank's gradient a share)
and expert parallelism (the tiny MoE model at ep=2 x tp=2 x dp_shard=2: experts sharded over ep
and efsdp, the rest over fsdp and tp) the reported norm of every step equals the one-process
run's (rtol 1e-5) while clipping, and so do the losses (rtol 1.5e-4).

(Parameters after several AdamW steps are not compared element by element: Adam divides each
gradient by its own magnitude, so an element whose gradient is a rounding error away from zero
moves by about the learning rate either way.  The losses of the later steps check the updates.)"""

from __future__ import annotations

import math
from typing import Any

import pytest
from train_reference import plain_torch_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train
from hp_models.trainer.lr_schedule import LRSchedule

pool4 = rank_pool_fixture(4, timeout=300)

STEPS, BATCH, SEQ, LR, MAX_NORM = 4, 8, 16, 1e-2, 0.5
SCHEDULE = ["--lr-warmup-steps", "1", "--lr-decay", "linear", "--lr-min", "1e-3", "--lr-decay-steps", str(STEPS - 1)]


def _argv(out: Any, steps: int, *layout: str) -> list[str]:
    return [*layout, "--steps", str(steps), "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--lr", str(LR),
            "--max-grad-norm", str(MAX_NORM), *SCHEDULE, "--checkpoint-every", "100", "--out-dir", str(out),
            "--overwrite"]


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own loop on this rank: its result and the whole gradients its parameters hold
    after the last step (clipped)."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    done = train.fit(args, layout, config, rank, distributed=True, quiet=True)
    grads = {}
    for name, p in done.model.named_parameters():  # (a pipeline stage holds its own layers only)
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    r = done.result
    return {"losses": r["losses"], "grad_norms": r["grad_norms"], "lrs": r["learning_rates"], "grads": grads,
            "layout": layout.as_dict()}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    from hp_models.job import OptimSettings
    from hp_protocols import LRDecay

    schedule = LRSchedule.of(LR, OptimSettings(warmup_steps=1, decay=LRDecay.LINEAR, decay_steps=STEPS - 1, lr_min=1e-3), STEPS)
    ref = plain_torch_run(STEPS, BATCH, SEQ, schedule.at, MAX_NORM)
    ref["lrs"] = [schedule.at(s) for s in range(STEPS)]
    return ref


def _check(pool: RankPool, tmp_path: Any, ref: dict[str, Any], what: str, *layout: str) -> dict[str, Any]:
    import torch

    assert sum(n > MAX_NORM for n in ref["grad_norms"]) >= 2 and ref["grad_norms"][0] > MAX_NORM  # clipping is on
    res = pool.run(_run, _argv(tmp_path, STEPS, *layout), timeout=300)
    worst_norm = 0.0
    for r in res:
        assert r["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1.5e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1.5e-4,
                                   atol=1e-5)
        worst_norm = max(worst_norm, max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"])))
    # the first step's gradients after clipping, every parameter on the ranks that hold it
    first = pool.run(_run, _argv(tmp_path, 1, *layout), timeout=300)
    want = ref["first_grads"]
    worst_grad, seen = 0.0, dict[str, Any]()
    for r in first:
        for name, g in r["grads"].items():
            diff = float((g - want[name]).abs().max())
            torch.testing.assert_close(g, want[name], rtol=1.5e-4, atol=1e-5, msg=f"{name}: max diff {diff:.3e}")
            worst_grad = max(worst_grad, diff)
            seen[name] = g
    assert set(seen) == set(want)
    clipped = math.sqrt(sum(float(g.double().pow(2).sum()) for g in seen.values()))
    assert clipped == pytest.approx(MAX_NORM, rel=1e-5)  # scaled down to the limit
    print(f"\n{what}: norms {[f'{n:.4f}' for n in ref['grad_norms']]} (max {MAX_NORM}); worst rel norm diff "
          f"{worst_norm:.2e}; step-1 clipped gradients: worst diff {worst_grad:.2e}, their norm {clipped:.6f}")
    return res[0]


def test_tp2_dp_shard2_clips_as_one_process(pool4: RankPool, reference, tmp_path) -> None:
    out = _check(pool4, tmp_path, reference, "tp=2 x dp_shard=2", "--tp", "2", "--dp-shard", "2", "--nproc", "4")
    assert out["layout"]["dp_shard"] == 2 and out["layout"]["tp"] == 2


def test_pp2_tp2_clips_as_one_process(pool4: RankPool, reference, tmp_path) -> None:
    """The stages hold different layers: their squared norms are summed over the pp ranks."""
    out = _check(pool4, tmp_path, reference, "pp=2 x tp=2", "--pp", "2", "--tp", "2", "--nproc", "4")
    assert out["layout"]["pp"] == 2


# ---------------------------------------------------------------- context and expert parallelism
CP2 = """
model: {use_attn_mask_compression: true}
parallelism: {data_parallel_shard: 2, context_parallel: 2, tensor_parallel: 1}
training: {global_batch_size: 8, local_batch_size: 2}
"""
EP2 = """
parallelism: {tensor_parallel: 2, expert_parallel: 2, disable_gradient_division: false}
training: {global_batch_size: 8, local_batch_size: 2}
"""
CLIP_STEPS = 3


def _norms(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    r = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": r["losses"], "grad_norms": r["grad_norms"], "layout": layout.as_dict()}


@pytest.mark.parametrize("job,flags,layout", [
    (CP2, [], {"cp": 2, "dp_shard": 2, "accumulation_steps": 2}),
    (EP2, ["--config", "tiny-moe"], {"ep": 2, "tp": 2, "dp_shard": 2, "efsdp": 2, "accumulation_steps": 2}),
], ids=["cp2-dp2", "ep2-tp2-dp2-moe"])
def test_cp_and_ep_clip_the_one_process_norm(pool4: RankPool, job: str, flags: list[str], layout: dict[str, Any],
                                             tmp_path) -> None:
    import torch
    from train_reference import single_process_run

    path = tmp_path / "job.yaml"
    path.write_text(job)
    argv = ["--job", str(path), *flags, "--steps", str(CLIP_STEPS), "--seq-len", str(SEQ), "--lr", str(LR),
            "--max-grad-norm", str(MAX_NORM), *SCHEDULE[:2], "--checkpoint-every", "100"]
    one = single_process_run(argv, tmp_path / "single")
    assert all(n > MAX_NORM for n in one["grad_norms"]), one["grad_norms"]  # every step clips
    res = pool4.run(_norms, [*argv, "--nproc", "4", "--out-dir", str(tmp_path / "run")], timeout=300)
    assert all(res[0]["layout"][k] == v for k, v in layout.items()), res[0]["layout"]
    for r in res:  # every rank reports (and clips by) the same norm
        assert r["grad_norms"] == res[0]["grad_norms"] and r["losses"] == res[0]["losses"]
    got = res[0]
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one["losses"]), rtol=1.5e-4, atol=1e-5)
    norm_diff = max(abs(a - b) / b for a, b in zip(got["grad_norms"], one["grad_norms"]))
    loss_diff = max(abs(a - b) / b for a, b in zip(got["losses"], one["losses"]))
    print(f"\n{'/'.join(f'{k}={v}' for k, v in layout.items())}: norms {[f'{n:.5f}' for n in got['grad_norms']]} "
          f"(clipped to {MAX_NORM}), worst rel diff vs one process {norm_diff:.2e}; losses worst rel diff "
          f"{loss_diff:.2e}")
