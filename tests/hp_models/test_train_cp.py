# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The trainer under context parallelism on 4 gloo ranks: the three example jobs (colossal cp=2 x
dp_shard=2 on causal data; ulysses cp=4 and hybrid cp=4 (ulysses 2) on packed documents) and
colossal cp=2 x tp=2 report the losses of the same run on one process (packed documents run
there one document per row); a cp=2 checkpoint resumes at cp=1 with the straight run's losses.
Jobs context parallelism cannot run fail before any rank starts with the documented error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_reference import single_process_run, worst_difference

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train
from hp_models.job import ModelSizes, Overrides, plan

pool4 = rank_pool_fixture(4, timeout=300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COLOSSAL = str(EXAMPLES / "qwen3_5_cp_colossal.yaml")
ULYSSES = str(EXAMPLES / "qwen3_5_cp_ulysses.yaml")
HYBRID = str(EXAMPLES / "qwen3_5_cp_hybrid.yaml")
# 64 tokens: over cp=4 chunks of 8, each holding parts of several packed documents (4 to 20 tokens)
SHORT = ["--seq-len", "64", "--lr", "1e-2", "--checkpoint-every", "100"]
# fp32 losses of the same run on one process: another summation order only
TOL = 2e-5
TINY = ModelSizes(num_attention_heads=8, num_hidden_layers=4)


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank: parse, check, train."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict(), "start": out["start_step"],
            "describe": layout.describe()}


@pytest.mark.parametrize("job,flags,layout", [
    (COLOSSAL, [], {"cp": 2, "cp_method": "colossal", "dp_shard": 2, "tp": 1, "accumulation_steps": 2}),
    (COLOSSAL, ["--tp", "2", "--dp-shard", "1"], {"cp": 2, "cp_method": "colossal", "dp_shard": 1, "tp": 2}),
    (ULYSSES, ["--nproc", "4"], {"cp": 4, "cp_method": "ulysses", "ulysses_degree": 4, "dp_shard": 1}),
    (HYBRID, ["--nproc", "4"], {"cp": 4, "cp_method": "hybrid", "ulysses_degree": 2, "dp_shard": 1}),
], ids=["A-colossal-cp2-fsdp2", "colossal-cp2-tp2", "B-ulysses-cp4-eod", "C-hybrid-cp4-u2-eod"])
def test_example_cp_job_equals_one_process(pool4: RankPool, job: str, flags: list[str], layout: dict[str, Any],
                                           tmp_path) -> None:
    argv = ["--job", job, *flags, "--steps", "2", "--out-dir", str(tmp_path), *SHORT]
    res = pool4.run(_run, argv)
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    assert all(r["losses"] == res[0]["losses"] for r in res)  # every rank reports the same losses
    single = single_process_run(argv, tmp_path / "single")["losses"]
    worst = worst_difference(res[0]["losses"], single)
    print(f"\n[train cp] {res[0]['describe']}: losses {res[0]['losses']}\n  one process {single}\n"
          f"  max |diff| {worst:.2e}")
    assert worst < TOL, (res[0]["losses"], single)


def test_checkpoint_reshards_from_cp2_to_cp1(pool4: RankPool, tmp_path) -> None:
    """cp=2 x dp_shard=2 saves at step 2, and dp_shard=4 without CP resumes to step 4: the straight
    run's losses (a checkpoint keeps the whole model's names under every layout)."""
    straight = single_process_run(["--job", COLOSSAL, "--steps", "4", *SHORT], tmp_path / "ref")["losses"]
    out = tmp_path / "run"
    part = pool4.run(_run, ["--job", COLOSSAL, "--steps", "2", "--out-dir", str(out), *SHORT])
    resumed = pool4.run(_run, ["--job", COLOSSAL, "--cp", "1", "--dp-shard", "4", "--steps", "4", "--out-dir",
                               str(out), "--resume", *SHORT])
    assert resumed[0]["start"] == 2 and resumed[0]["losses"][:2] == part[0]["losses"]
    worst = worst_difference(resumed[0]["losses"], straight)
    print(f"\n[train cp checkpoint] {part[0]['describe']} saved step 2, {resumed[0]['describe']} resumed to 4: "
          f"max |loss - straight| {worst:.2e}")
    assert worst < TOL, (resumed[0]["losses"], straight)


# ---------------------------------------------------------------- before any rank starts
COMPRESSED = {"model": {"use_attn_mask_compression": True}}
SEED_TEXT = ("Context parallel (context_parallel > 1) requires a compressed attention mask. Please enable "
             "use_attn_mask_compression for non-eod data, or create_compressed_eod_mask for eod data.")


@pytest.mark.parametrize("parallelism,extra,argv,words", [
    ({"context_parallel": 2}, COMPRESSED, ["--seq-len", "30"],
     ["sequence length 30", "context_parallel 2", "multiple of 4", "pad to 32"]),
    ({"context_parallel": 3, "context_parallel_method": "ulysses"}, COMPRESSED, ["--seq-len", "36"],
     ["num_attention_heads 8 is not divisible by 3"]),
    ({"context_parallel": 4, "context_parallel_method": "ulysses", "tensor_parallel": 4}, COMPRESSED, [],
     ["num_attention_heads 2 is not divisible by 4", "(num_attention_heads 8 over tensor_parallel 4)"]),
    ({"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 4}, COMPRESSED, [],
     ["hybrid needs 1 < ulysses_degree_in_cp < context_parallel", "ulysses_degree_in_cp 4"]),
    ({"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 3}, COMPRESSED, [],
     ["context_parallel % ulysses_degree_in_cp == 0", "ulysses_degree_in_cp 3"]),
    ({"context_parallel": 2}, {}, [], [SEED_TEXT]),
    ({"context_parallel": 2, "context_parallel_mask_type": "full"}, COMPRESSED, [],
     ["context_parallel_mask_type 'full' is not supported", "only 'causal'"]),
    ({"context_parallel": 2}, COMPRESSED, ["--seq-len", "4"], ["chunks of 1 tokens", "at least 12"]),
], ids=["seq-not-divisible", "ulysses-heads", "ulysses-heads-per-tp-rank", "hybrid-degree-equal",
        "hybrid-degree-indivisible", "missing-compression", "mask-type-full", "chunk-shorter-than-conv"])
def test_bad_cp_job_fails_before_any_rank_starts(parallelism, extra, argv, words, tmp_path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"parallelism": parallelism, "training": {"global_batch_size": 4}, **extra}))
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job), "--out-dir", str(tmp_path / "out"), *argv])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


def test_mask_type_full_is_not_implemented() -> None:
    raw = {"parallelism": {"context_parallel": 2, "context_parallel_mask_type": "full"}, **COMPRESSED}
    with pytest.raises(NotImplementedError, match="context_parallel_mask_type 'full' is not supported"):
        plan(raw, Overrides(), TINY)


def test_cp_inside_a_pipeline_is_planned() -> None:
    """pp x cp is a layout the trainer runs (``test_train_pp_cp`` trains it): each stage's ranks
    form its CP group and FSDP shards over dp_shard * cp."""
    layout = plan({**COMPRESSED, "parallelism": {"data_parallel_shard": 1}}, Overrides(cp=2, pp=2), TINY)
    assert (layout.world_size, layout.pp, layout.cp, layout.dims.fsdp, layout.accumulation) == (4, 2, 2, 2, 2)
    assert layout.split is not None and layout.split.layers == ((0, 1), (2, 3))
    assert layout.describe() == "pp=2, cp=2 colossal, tp=1 on 4 ranks"


def test_cp_flag_and_fsdp_over_dp_shard_times_cp() -> None:
    layout = plan({**COMPRESSED, "parallelism": {"data_parallel_shard": 1}}, Overrides(cp=4), TINY)
    assert (layout.world_size, layout.cp, layout.dp, layout.dims.fsdp, layout.uses_fsdp) == (4, 4, 1, 4, True)
    assert layout.describe() == "cp=4 colossal, tp=1 on 4 ranks"


def test_mindspore_refuses_context_parallelism_at_startup(monkeypatch, tmp_path) -> None:
    """hp_cp has no MindSpore code: with MindSpore selected the trainer says so, and what to do,
    before any rank starts.  (This resolve has no MindSpore: the selection is stood in for; the
    package lookup and the trainer's check are the real ones.)"""
    import hp_dtensor.platform as platform

    monkeypatch.setattr(platform, "platform_name", lambda: "mindspore")
    platform.package_backend.cache_clear()  # a lookup made under torch earlier in this process
    try:
        with pytest.raises(SystemExit) as info:
            train.main(["--job", COLOSSAL, "--out-dir", str(tmp_path / "out")])
    finally:
        platform.package_backend.cache_clear()
    msg = str(info.value.code)
    words = ["context_parallel 2", "context parallelism is not supported on the mindspore backend",
             "HYPER_PARALLEL_PLATFORM=torch", "context_parallel: 1"]
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()
