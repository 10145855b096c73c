# mypy: disable-error-code="no-untyped-def,index"
"""Gradient clipping by the global norm across every mesh dim: on 4 gloo ranks as tp=2 x
dp_shard=2 (and pp=2 x tp=2) the trainer's reported gradient norms, losses and final parameters
equal plain torch on one process with ``torch.nn.utils.clip_grad_norm_`` (and the learning-rate
schedule), while clipping is active; without clipping the parameters would differ."""

from __future__ import annotations

from typing import Any

import pytest
from train_reference import plain_torch_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train
from hp_models.trainer.lr_schedule import LRSchedule

pool4 = rank_pool_fixture(4, timeout=300)

STEPS, BATCH, SEQ, LR, MAX_NORM = 4, 8, 16, 1e-2, 0.5
SCHEDULE = ["--lr-warmup-steps", "1", "--lr-decay", "linear", "--lr-min", "1e-3"]


def _argv(out: Any, *layout: str) -> list[str]:
    return [*layout, "--steps", str(STEPS), "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--lr", str(LR),
            "--max-grad-norm", str(MAX_NORM), *SCHEDULE, "--checkpoint-every", "100", "--out-dir", str(out)]


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own loop on this rank: its result and the whole parameters it holds."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    done = train.fit(args, layout, config, rank, distributed=True, quiet=True)
    params = {}
    for name, p in done.model.named_parameters():  # (a pipeline stage holds its own layers only)
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().clone()
    r = done.result
    return {"losses": r["losses"], "grad_norms": r["grad_norms"], "lrs": r["learning_rates"], "params": params,
            "layout": layout.as_dict()}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    from hp_models.job import OptimSettings
    from hp_protocols import LRDecay

    schedule = LRSchedule.of(LR, OptimSettings(warmup_steps=1, decay=LRDecay.LINEAR, lr_min=1e-3), STEPS)
    clipped = plain_torch_run(STEPS, BATCH, SEQ, schedule.at, MAX_NORM)
    clipped["lrs"] = [schedule.at(s) for s in range(STEPS)]
    clipped["unclipped_params"] = plain_torch_run(STEPS, BATCH, SEQ, schedule.at, None)["params"]
    return clipped


def _check(res: list[dict[str, Any] | None], ref: dict[str, Any], what: str) -> None:
    import torch

    assert sum(n > MAX_NORM for n in ref["grad_norms"]) >= 2, ref["grad_norms"]  # clipping is active
    worst_norm = worst_param = 0.0
    holders: dict[str, int] = {}
    for r in res:
        assert r is not None
        assert r["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1.5e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1.5e-4,
                                   atol=1e-5)
        worst_norm = max(worst_norm, max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"])))
        for name, p in r["params"].items():
            holders[name] = holders.get(name, 0) + 1
            want = ref["params"][name]
            torch.testing.assert_close(p, want, rtol=1.5e-4, atol=1e-5, msg=name)
            worst_param = max(worst_param, float((p - want).abs().max()))
    assert set(holders) == set(ref["params"])  # every parameter checked on some rank
    moved = max(float((ref["params"][n] - ref["unclipped_params"][n]).abs().max()) for n in ref["params"])
    assert moved > 100 * max(worst_param, 1e-6), (moved, worst_param)  # clipping changed the result
    print(f"\n{what}: norms {[f'{n:.4f}' for n in ref['grad_norms']]} (max {MAX_NORM}); worst rel norm diff "
          f"{worst_norm:.2e}, worst param diff {worst_param:.2e} (clipping moves them by {moved:.2e})")


def test_tp2_dp_shard2_clips_as_one_process(pool4: RankPool, reference, tmp_path) -> None:
    res = pool4.run(_run, _argv(tmp_path, "--tp", "2", "--dp-shard", "2", "--nproc", "4"), timeout=300)
    assert res[0]["layout"]["dp_shard"] == 2 and res[0]["layout"]["tp"] == 2
    _check(res, reference, "tp=2 x dp_shard=2")


def test_pp2_tp2_clips_as_one_process(pool4: RankPool, reference, tmp_path) -> None:
    """The stages hold different layers: their squared norms are summed over the pp ranks."""
    res = pool4.run(_run, _argv(tmp_path, "--pp", "2", "--tp", "2", "--nproc", "4"), timeout=300)
    assert res[0]["layout"]["pp"] == 2
    _check(res, reference, "pp=2 x tp=2")
