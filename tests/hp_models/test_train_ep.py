# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The trainer with expert parallelism on 4 gloo ranks: the tiny MoE model from a job file at
ep=2 x tp=2 (dp_shard 2, accumulation 2, gradients averaged), at ep=1 x tp=2 x dp_shard 2 (each
expert TP-split over etp=2 and FSDP-sharded over edp=2) and the two examples (ep=2 with tp=4, each
expert TP-split over the etp=2 TP ranks sharing its ep coordinate; ep=4 with tp=2, EP across the
TP groups) report the
losses of the same run on one process (the trainer's ``--compare-single`` reference), and the
same tokens per expert in every layer and step; what the MoE path cannot run is refused before
any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_reference import single_process_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EP_LE_TP = str(EXAMPLES / "qwen3_5_moe_ep_le_tp.yaml")
EP_GT_TP = str(EXAMPLES / "qwen3_5_moe_ep_gt_tp.yaml")
EP2_TP2 = """
parallelism:
  tensor_parallel: 2
  expert_parallel: 2
  disable_gradient_division: False
training:
  global_batch_size: 8
  local_batch_size: 2
"""
# ep=1 under tp=2: each expert is split like a TP MLP over the two TP ranks (etp=2) and fully
# sharded over the two data-parallel ranks (edp=2), the TP split and FSDP of one parameter.
ETP2_DP2 = """
parallelism:
  tensor_parallel: 2
  data_parallel_shard: 2
  expert_parallel: 1
  disable_gradient_division: False
training:
  global_batch_size: 8
  local_batch_size: 2
"""
# HSDP: 2 replicas of 2 shards, ep=2 over the shard ranks (efsdp=1): dense parameters HSDP over
# (dp_replicate, fsdp), experts over (dp_replicate, efsdp), each expert's gradient all-reduced
# across the replicas.
HSDP_EP2 = """
parallelism:
  tensor_parallel: 1
  data_parallel_shard: 2
  expert_parallel: 2
  disable_gradient_division: False
training:
  global_batch_size: 8
  local_batch_size: 1
"""
SHORT = ["--config", "tiny-moe", "--steps", "3", "--seq-len", "16", "--lr", "1e-2", "--checkpoint-every", "100"]
TOL = 2e-5  # fp32 losses of the same run on one process: another summation order only


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank: parse, check, train."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict(), "describe": layout.describe(),
            "load": out["tokens_per_expert"]}


def _expert_layout(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """How the trainer's model holds its routed experts on this rank: the mesh dims and
    placements of each expert parameter, and the share of the experts' elements held here."""
    from hp_dtensor import DTensor
    from hp_models.train_moe import build_moe_model

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    model, _ = build_moe_model(args.seed, layout, config, distributed=True)
    held = total = 0
    layouts = set()
    for name, p in model.named_parameters():
        if ".experts." in name:
            assert isinstance(p, DTensor), name
            layouts.add((name.rsplit(".", 1)[-1], p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))))
            held, total = held + p.to_local().numel(), total + p.numel()
    import torch

    logits = model(torch.zeros(2, 16, dtype=torch.long))  # loss parallel: logits stay split over the vocab
    return {"layouts": sorted(layouts), "share": held / total,
            "logits": tuple(map(str, logits.placements)) if isinstance(logits, DTensor) else None}


@pytest.mark.parametrize("job", [ETP2_DP2, EP_LE_TP], ids=["etp2xedp2", "example-ep2-le-tp4"])
def test_experts_keep_a_tp_split_when_ep_le_tp(pool4: RankPool, job: str, tmp_path) -> None:
    """With ep <= tp the experts are split like a TP MLP over the etp ranks (gate/up by column,
    down by row) on the (ep, etp) dims, then fully sharded over what is left (edp): a rank holds a
    quarter of every expert tensor's elements on 4 ranks either way, but a TP slice of each.  The
    logits stay split over the vocab under TP (loss parallel), as in the dense trainer."""
    ranks = []
    if not job.endswith(".yaml"):
        (tmp_path / "job.yaml").write_text(job)
        job, ranks = str(tmp_path / "job.yaml"), ["--nproc", "4"]
    res = pool4.run(_expert_layout, ["--job", job, *ranks, "--out-dir", str(tmp_path / "run"), *SHORT])
    assert all(r["share"] == 0.25 for r in res), [r["share"] for r in res]
    assert all(r["logits"] == ("S(2)",) for r in res), [r["logits"] for r in res]
    layouts = {name: (dims, placements) for name, dims, placements in res[0]["layouts"]}
    assert sorted(layouts) == ["down_proj", "gate_proj", "up_proj"], layouts
    for name, split in (("gate_proj", "S(1)"), ("up_proj", "S(1)"), ("down_proj", "S(2)")):
        dims, placements = layouts[name]
        assert dims[:2] == ("ep", "etp") and placements[:2] == ("S(0)", split), (name, dims, placements)
    print(f"\n[train etp] expert layouts {res[0]['layouts']}; {res[0]['share']:.2f} of the expert elements per rank")


def _single(argv: list[str], out: Path) -> dict[str, Any]:
    """The same run on one process, as ``--compare-single`` trains it."""
    res = single_process_run(argv, out)
    return {"losses": res["losses"], "load": res["tokens_per_expert"]}


@pytest.mark.parametrize("job,layout", [
    (EP2_TP2, {"ep": 2, "efsdp": 2, "tp": 2, "dp_shard": 2, "accumulation_steps": 2, "sum_gradients": False}),
    (ETP2_DP2, {"etp": 2, "edp": 2, "tp": 2, "dp_shard": 2, "accumulation_steps": 2, "sum_gradients": False}),
    (EP_LE_TP, {"ep": 2, "efsdp": 2, "etp": 2, "edp": 1, "tp": 4, "dp_shard": 1, "accumulation_steps": 2,
                "sum_gradients": True}),
    (EP_GT_TP, {"ep": 4, "efsdp": 1, "tp": 2, "dp_shard": 2, "accumulation_steps": 2, "sum_gradients": True}),
    (HSDP_EP2, {"ep": 2, "efsdp": 1, "tp": 1, "dp_replicate": 2, "dp_shard": 2, "accumulation_steps": 2,
                "sum_gradients": False}),
], ids=["ep2xtp2-job", "etp2xdp2-job", "example-ep2-le-tp4", "example-ep4-gt-tp2", "hsdp2x2-ep2-job"])
def test_ep_job_equals_one_process(pool4: RankPool, job: str, layout: dict[str, Any], tmp_path) -> None:
    ranks = []  # an example names its ranks itself, as the README runs it
    if not job.endswith(".yaml"):
        (tmp_path / "job.yaml").write_text(job)
        job, ranks = str(tmp_path / "job.yaml"), ["--nproc", "4"]
    argv = ["--job", job, *ranks, "--out-dir", str(tmp_path / "run"), *SHORT]
    res = pool4.run(_run, argv)
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    assert all(r["losses"] == res[0]["losses"] and r["load"] == res[0]["load"] for r in res)  # the same on every rank
    single = _single(argv, tmp_path / "single")
    worst = max(abs(a - b) for a, b in zip(res[0]["losses"], single["losses"]))
    load = res[0]["load"]
    # 8 samples x 16 tokens x top-2 routed copies per layer and step, every one counted once
    assert load["copies_per_step"] == 8 * 16 * 2 and all(sum(row) == 256 for s in load["per_step"] for row in s)
    assert load["per_step"] == single["load"]["per_step"], "tokens per expert differ from one process"
    spread = [(lay["step_min"], lay["step_max"]) for lay in load["per_layer"]]
    print(f"\n[train ep] {res[0]['describe']}: losses {res[0]['losses']}\n  one process {single['losses']}\n"
          f"  max |diff| {worst:.2e}; tokens per expert per step (min, max) by layer {spread}, equal to one process "
          f"in all {len(load['per_step'])} steps x {len(spread)} layers x {load['experts']} experts")
    assert len(res[0]["losses"]) == 3 and worst < TOL, (res[0]["losses"], single["losses"])


def test_summary_prints_tokens_per_expert(tmp_path, capsys) -> None:
    """On one process (the summary's code path is the same for any layout)."""
    out = tmp_path / "one"
    assert train.main([*SHORT, "--tp", "1", "--steps", "2", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens per expert (8 experts, 256 routed token copies per layer per step, even share 32" in text, text
    assert all(f"    layer {i}: per step min " in text for i in range(4)) and "all layers: per step min" in text


# ---------------------------------------------------------------- before any rank starts
@pytest.mark.parametrize("config,parallelism,words", [
    ("tiny", {"expert_parallel": 2},
     ["expert_parallel=2 needs a mixture-of-experts model", "--config tiny-moe", "expert_parallel: 1"]),
    ("tiny-moe", {"tensor_parallel": 1, "expert_parallel": 4, "moe_token_dispatcher_type": "alltoall_deredundancy",
                  "npu_nums_per_device": 3},
     ["expert_parallel (4) to be a multiple of npu_nums_per_device (3)", "whole nodes"]),
    ("tiny-moe", {"tensor_parallel": 1, "expert_parallel": 4, "moe_token_dispatcher_type": "alltoall_deredundancy"},
     ["alltoall_deredundancy needs expert_parallel (4) >= npu_nums_per_device (8)"]),
    ("tiny-moe", {"tensor_parallel": 1, "expert_parallel": 3}, ["expert_parallel 3 must divide dp_shard*cp*tp", "4"]),
    ("tiny-moe", {"tensor_parallel": 1, "moe_token_dispatcher_type": "ring"}, ["moe_token_dispatcher_type", "'ring'"]),
])
def test_bad_moe_job_fails_before_any_rank_starts(config, parallelism, words, tmp_path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"parallelism": parallelism}))
    with pytest.raises(SystemExit) as info:
        train.main(["--config", config, "--job", str(job), "--nproc", "4", "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


def test_experts_not_divisible_by_ep_and_ep_flag() -> None:
    from hp_models.job import ModelSizes, Overrides, plan

    moe = ModelSizes(num_attention_heads=8, num_hidden_layers=4, num_experts=6)
    with pytest.raises(ValueError, match="expert_parallel=4 does not divide the model's 6 experts"):
        plan(None, Overrides(tp=1, ep=4), moe, world_size=4)
    layout = plan(None, Overrides(tp=2, ep=4), ModelSizes(8, 4, num_experts=8), world_size=4)
    assert (layout.dims.ep, layout.dims.efsdp, layout.moe.experts_per_rank) == (4, 1, 2)
    assert layout.describe() == "dp_shard=2, ep=4, tp=2 on 4 ranks"


def test_moe_hsdp_replicates_the_experts_shard_groups(pool4: RankPool, tmp_path) -> None:
    """With replicas the experts are HSDP too: each expert tensor keeps its ep shard, replicated
    over dp_replicate and sharded over efsdp (of one rank here), so a rank holds half of it."""
    (tmp_path / "job.yaml").write_text(HSDP_EP2)
    argv = ["--job", str(tmp_path / "job.yaml"), "--nproc", "4", "--out-dir", str(tmp_path / "run"), *SHORT]
    res = pool4.run(_expert_layout, argv)
    assert all(r["share"] == 0.5 for r in res), [r["share"] for r in res]
    for name, dims, placements in res[0]["layouts"]:
        assert dims == ("ep", "dp_replicate", "efsdp") and placements == ("S(0)", "R", "S(0)"), (name, dims, placements)
    assert all(r["logits"] is None for r in res)  # tp=1: plain logits
