# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""The trainer on MindSpore (``--backend mindspore``): the main job on 4 mccl ranks equals one
MindSpore process and the torch trainer on one process, from the same initial weights on the
same data (fp32: losses rtol 1.5e-4; gradient norms and learning rates too).

- (dp_shard=2, tp=2), 5 steps of the default job (constant learning rate, no clipping);
- HSDP (dp_replicate=2 x dp_shard=2) with 2 accumulation micro-steps, a warmup and cosine decay
  and gradient clipping (the norm, about 2.3, is above max_grad_norm 1), 3 steps.

The torch trainer's (dp_shard=2, tp=2) run equals its one-process run in
``tests/hp_models/test_train_fsdp.py``; here the torch reference is its one-process run.
"""

from __future__ import annotations

import numpy as np
import pytest
from train_ms_cases import job, ms_run, torch_single

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}
SMALL = ["--seq-len", "16", "--batch-size", "4"]

CASES = {
    "dp_shard=2,tp=2": (["--tp", "2", "--dp-shard", "2", "--steps", "5", *SMALL], 5),
    "hsdp 2x2, accumulation 2, clip, cosine": (
        ["--tp", "1", "--dp-shard", "2", "--nproc", "4", "--steps", "3", "--seq-len", "16", "--batch-size", "8",
         "--local-batch-size", "2", "--max-grad-norm", "1.0", "--lr-warmup-steps", "1", "--lr-decay", "cosine"], 3),
}


def _worst_rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


@pytest.mark.parametrize("name", list(CASES))
def test_ms_trainer_equals_one_process_and_torch(ms_pool: RankPool, torch_pool: RankPool, name: str,
                                                 tmp_path) -> None:
    flags, steps = CASES[name]
    args, layout = job(["--backend", "mindspore", *flags], 4, str(tmp_path / "ms"))
    single_args, single = job(["--backend", "mindspore", *flags, "--nproc", "1", "--tp", "1", "--dp-shard", "1"], 1,
                              str(tmp_path / "ms-single"))
    torch_args, _ = job([*flags, "--nproc", "1", "--tp", "1", "--dp-shard", "1", "--backend", "torch",
                         "--checkpoint-every", "100"], 1, str(tmp_path / "torch"))
    assert layout.world_size == 4 and single.world_size == 1
    weights = str(tmp_path / "initial.npz")
    (ref,) = torch_pool.run(torch_single, torch_args, single, weights)
    runs = ms_pool.run(ms_run, args, layout, weights)
    (one, *_rest) = ms_pool.run(ms_run, single_args, single, weights, single=True)
    ours = runs[0]
    for r in runs[1:]:
        assert r["losses"] == ours["losses"] and r["grad_norms"] == ours["grad_norms"]  # every rank's figures
    assert len(ours["losses"]) == len(one["losses"]) == len(ref["losses"]) == steps
    np.testing.assert_allclose(ours["losses"], one["losses"], err_msg="4 ranks vs one MindSpore process", **TOL)
    np.testing.assert_allclose(ours["losses"], ref["losses"], err_msg="MindSpore vs the torch trainer", **TOL)
    np.testing.assert_allclose(one["losses"], ref["losses"], err_msg="one MindSpore process vs torch", **TOL)
    np.testing.assert_allclose(ours["grad_norms"], ref["grad_norms"], err_msg="gradient norms", **TOL)
    assert ours["learning_rates"] == ref["learning_rates"]
    assert ours["nparams"] == one["nparams"] == ref["nparams"]
    assert len(ours["peak_memory_mib_per_rank"]) == 4
    print(f"{name} ({layout.describe()}): {steps} steps, worst loss rel diff vs 1 process "
          f"{_worst_rel(ours['losses'], one['losses']):.1e}, vs torch {_worst_rel(ours['losses'], ref['losses']):.1e}; "
          f"grad norms vs torch {_worst_rel(ours['grad_norms'], ref['grad_norms']):.1e}; losses {ours['losses']}")
