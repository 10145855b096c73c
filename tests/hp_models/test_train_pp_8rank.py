# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The trainer's pipeline composed with every other dense dimension at once, on 8 gloo ranks:
pp=2 x dp_shard=2 x tp=2 (TP inside each stage, FSDP over the stage's data-parallel ranks) and
HSDP under the pipeline, pp=2 x dp_replicate=2 x dp_shard=2, and context parallelism with TP
inside each stage, pp=2 x cp=2 x tp=2 on packed documents.  Each reports the losses of the same
global batches trained on one process; every rank reports the same curve, and each rank holds
its share of only its own stage's parameters."""

from __future__ import annotations

from typing import Any

import pytest
from train_reference import single_process_run, worst_difference

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool8 = rank_pool_fixture(8, timeout=300)

SHORT = ["--steps", "3", "--seq-len", "16", "--lr", "1e-2", "--checkpoint-every", "100"]
TOL = 2e-5  # fp32 losses of the same batches on one process: another summation order only


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank, and the elements of the model this rank holds."""
    from hp_dtensor import DTensor

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    trained = train.fit(args, layout, config, rank, distributed=True, quiet=True)
    params = list(trained.model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return {"losses": trained.result["losses"], "layout": layout.as_dict(), "local_elements": local,
            "stage_elements": sum(p.numel() for p in params)}


def _whole_model() -> Any:
    from hp_models.qwen3_5 import tiny_config

    return tiny_config().build()


@pytest.mark.parametrize("flags,layout,replicas", [
    (["--pp", "2", "--dp-shard", "2", "--tp", "2"], {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}, 1),
    (["--pp", "2", "--dp-shard", "2", "--tp", "1"], {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 1}, 2),
], ids=["pp2-dp_shard2-tp2", "pp2-hsdp2x2"])
def test_pipeline_with_fsdp_tp_and_hsdp_equals_one_process(pool8: RankPool, flags: list[str],
                                                           layout: dict[str, Any], replicas: int, tmp_path) -> None:
    argv = [*flags, "--nproc", "8", "--out-dir", str(tmp_path), *SHORT]
    res = pool8.run(_run, argv)
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    assert all(r["losses"] == res[0]["losses"] for r in res)
    # a rank holds a share of its own stage only: at most half of it (sharded over dp_shard=2 at
    # least); the stages' 4 ranks each count the stage once, so the whole model is the sum / 4
    whole = sum(r["stage_elements"] for r in res) // 4
    assert whole == sum(p.numel() for p in _whole_model().parameters())
    assert all(2 * r["local_elements"] <= r["stage_elements"] + 64 for r in res), res
    total = sum(r["local_elements"] for r in res)
    if layout["tp"] == 1:  # FSDP alone splits every parameter: each replica holds the model once
        assert total == whole * replicas, (total, whole, replicas)
    else:  # TP replicates its norms over the tp ranks; everything else is held once
        assert whole <= total < whole * 1.05, (total, whole)
    single = single_process_run(argv, tmp_path / "single")["losses"]
    worst = worst_difference(res[0]["losses"], single)
    print(f"\n[train pp 8 ranks] {layout}: losses {res[0]['losses']}, one process {single}, max |diff| {worst:.2e}; "
          f"{total:,} elements held over 8 ranks ({replicas} replica(s) of {whole:,})")
    assert worst < TOL, (res[0]["losses"], single)


def test_pipeline_with_context_and_tensor_parallel_equals_one_process(pool8: RankPool, tmp_path) -> None:
    """pp=2 x cp=2 x tp=2 on packed documents: TP (without sequence parallelism: CP splits the
    sequence) and CP inside each stage, FSDP over its dp_shard * cp = 2 ranks."""
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "parallelism": {"data_parallel_shard": 1, "tensor_parallel": 2, "context_parallel": 2,
                        "pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": "auto"},
        "train_dataset": {"dataloader": {"config": {"create_compressed_eod_mask": True,
                                                    "create_attention_mask": False}}},
        "training": {"global_batch_size": 8, "local_batch_size": 2},
    }))
    argv = ["--job", str(job), "--nproc", "8", "--out-dir", str(tmp_path), *SHORT, "--seq-len", "32"]
    res = pool8.run(_run, argv)
    for key, value in {"pp": 2, "cp": 2, "tp": 2, "dp_shard": 1, "accumulation_steps": 4}.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    assert all(r["losses"] == res[0]["losses"] for r in res)
    assert sum(r["stage_elements"] for r in res) // 4 == sum(p.numel() for p in _whole_model().parameters())
    single = single_process_run(argv, tmp_path / "single")["losses"]
    worst = worst_difference(res[0]["losses"], single)
    print(f"\n[train pp x cp x tp 8 ranks] losses {res[0]['losses']}, one process {single}, max |diff| {worst:.2e}")
    assert worst < TOL, (res[0]["losses"], single)
