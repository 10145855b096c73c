# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The trainer under pipeline parallelism on 4 gloo ranks: the two example jobs (8 layers, pp=2 x
interleave 2, ``auto``, tp=2; 10 layers, explicit "0-1, 4-8" / "2-3, 9", dp_shard=2) report the
losses of the same run at pp=1 on one process; a pp=2 checkpoint resumes at pp=1 (tp=2 x
dp_shard=2) and a pp=1 checkpoint at pp=2, continuing the straight run's losses; a pipeline
the schedules cannot run is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_reference import single_process_run, worst_difference

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INTERLEAVED_TP = str(EXAMPLES / "qwen3_5_pp_interleaved_tp.yaml")
EXPLICIT_FSDP = str(EXAMPLES / "qwen3_5_pp_explicit_fsdp.yaml")
FSDP_TP = str(EXAMPLES / "qwen3_5_fsdp_tp.yaml")
SHORT = ["--seq-len", "16", "--lr", "1e-2", "--checkpoint-every", "100"]
# fp32 losses of the same run at pp=1: another summation order only
TOL = 2e-5


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank: parse, check, train."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict(), "start": out["start_step"],
            "describe": layout.describe()}


@pytest.mark.parametrize("job,layout", [
    (INTERLEAVED_TP, {"pp": 2, "interleave": 2, "tp": 2, "dp_shard": 1, "accumulation_steps": 4,
                      "stage_layers": [[0, 1], [2, 3], [4, 5], [6, 7]]}),
    (EXPLICIT_FSDP, {"pp": 2, "interleave": 2, "tp": 1, "dp_shard": 2, "accumulation_steps": 2,
                     "stage_layers": [[0, 1], [2, 3], [4, 5, 6, 7, 8], [9]]}),
], ids=["8L-auto-interleaved-tp2", "10L-explicit-fsdp2"])
def test_example_pp_job_equals_pp1(pool4: RankPool, job: str, layout: dict[str, Any], tmp_path) -> None:
    argv = ["--job", job, "--steps", "2", "--out-dir", str(tmp_path), *SHORT]
    res = pool4.run(_run, argv)
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    assert all(r["losses"] == res[0]["losses"] for r in res)  # every rank reports the same losses
    single = single_process_run(argv, tmp_path / "single")["losses"]
    worst = worst_difference(res[0]["losses"], single)
    print(f"\n[train pp] {res[0]['describe']}: losses {res[0]['losses']}\n  pp=1 one process {single}\n"
          f"  max |diff| {worst:.2e}")
    assert worst < TOL, (res[0]["losses"], single)


def test_checkpoint_reshards_across_a_change_of_pp(pool4: RankPool, tmp_path) -> None:
    """pp=2 x tp=2 saves at step 3 and resumes at pp=1 (tp=2 x dp_shard=2) to step 5, and the other
    way round: each continues the losses of the straight 5-step run."""
    pp_argv = ["--job", FSDP_TP, "--pp", "2", "--dp-shard", "1", "--local-batch-size", "4"]
    straight = single_process_run(["--job", FSDP_TP, "--steps", "5", *SHORT], tmp_path / "ref")["losses"]
    results = {}
    for name, first, then in (("pp2->pp1", pp_argv, ["--job", FSDP_TP]), ("pp1->pp2", ["--job", FSDP_TP], pp_argv)):
        out = tmp_path / name.replace(">", "")
        part = pool4.run(_run, [*first, "--steps", "3", "--out-dir", str(out), *SHORT])
        resumed = pool4.run(_run, [*then, "--steps", "5", "--out-dir", str(out), "--resume", *SHORT])
        assert resumed[0]["start"] == 3 and resumed[0]["losses"][:3] == part[0]["losses"]
        results[name] = (worst_difference(resumed[0]["losses"], straight), part[0]["describe"], resumed[0]["describe"])
        assert results[name][0] < TOL, (resumed[0]["losses"], straight)
    for name, (worst, a, b) in results.items():
        print(f"\n[train pp checkpoint] {name}: {a} saved step 3, {b} resumed to 5: max |loss - straight| {worst:.2e}")


# ---------------------------------------------------------------- before any rank starts
@pytest.mark.parametrize("parallelism,training,words", [
    ({"pipeline_parallel": 2, "pipeline_parallel_interleave_num": 2, "pipeline_parallel_layers_per_stage": "auto"},
     {"model": 10}, ["auto needs num_hidden_layers (10) divisible", "2*2 = 4", "explicitly", "['0-2, 6-7', '3-5, 8-9']"]),
    ({"pipeline_parallel": 2, "pipeline_parallel_interleave_num": 2, "pipeline_parallel_layers_per_stage": "auto"},
     {"global_batch_size": 6, "local_batch_size": 2},
     ["interleaved 1F1B", "microbatches", "= 3", "multiple of pipeline_parallel 2"]),
    ({"pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": ["0-1", "1-3"]}, {},
     ["layers [1] appear more than once"]),
])
def test_bad_pipeline_fails_before_any_rank_starts(parallelism, training, words, tmp_path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    layers = training.pop("model", None)
    raw = {"parallelism": {"tensor_parallel": 1, **parallelism}, "training": training}
    if layers is not None:
        raw["model"] = {"num_hidden_layers": layers}
    job.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job), "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()
