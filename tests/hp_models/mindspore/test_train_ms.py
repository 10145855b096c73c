# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""The trainer on MindSpore (``--backend mindspore``): the main job at (dp_shard=2, tp=2) on 4
mccl ranks -- tensor parallelism with sequence parallelism and loss parallel, then FSDP -- equals
one MindSpore process and the torch trainer on one process over 5 steps of the default job
(constant learning rate, no clipping), from the same initial weights on the same data (fp32:
losses rtol 1.5e-4; gradient norms and learning rates too).  HSDP is in
``test_train_ms_hsdp.py``.

The torch trainer's (dp_shard=2, tp=2) run equals its one-process run in
``tests/hp_models/test_train_fsdp.py``; here the torch reference is its one-process run.
"""

from __future__ import annotations

from train_ms_cases import check_equals_one_process_and_torch

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})


def test_dp_shard2_tp2_equals_one_process_and_torch(ms_pool: RankPool, torch_pool: RankPool, tmp_path) -> None:
    flags = ["--tp", "2", "--dp-shard", "2", "--steps", "5", "--seq-len", "16", "--batch-size", "4"]
    check_equals_one_process_and_torch(ms_pool, torch_pool, "dp_shard=2,tp=2", flags, 5, tmp_path)
