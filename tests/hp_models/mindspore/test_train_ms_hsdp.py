# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""The trainer on MindSpore (``--backend mindspore``) with HSDP (dp_replicate=2 x dp_shard=2 on 4
mccl ranks), 2 accumulation micro-steps, a warmup and cosine decay and gradient clipping (the
norm, about 2.3, is above max_grad_norm 1), 3 steps: equal to one MindSpore process and to the
torch trainer on one process (fp32: losses rtol 1.5e-4; gradient norms and learning rates too).
(dp_shard=2, tp=2) is in ``test_train_ms.py``.
"""

from __future__ import annotations

from train_ms_cases import check_equals_one_process_and_torch

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(4, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(1, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})


def test_hsdp_accumulation_clip_cosine_equals_one_process_and_torch(ms_pool: RankPool, torch_pool: RankPool,
                                                                    tmp_path) -> None:
    flags = ["--tp", "1", "--dp-shard", "2", "--nproc", "4", "--steps", "3", "--seq-len", "16", "--batch-size", "8",
             "--local-batch-size", "2", "--max-grad-norm", "1.0", "--lr-warmup-steps", "1", "--lr-decay", "cosine"]
    check_equals_one_process_and_torch(ms_pool, torch_pool, "hsdp 2x2, accumulation 2, clip, cosine", flags, 3,
                                       tmp_path)
