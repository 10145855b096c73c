# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The trainer with context parallelism inside a pipeline on 4 gloo ranks: pp=2 x cp=2 trains 3
steps (the third's loss is the first to depend on AdamW moments the optimizer read back from its
state) with the losses of one process on the same data and weights (fp32, rtol 1.5e-4): colossal
on causal data, colossal on packed documents (EOD) with every layer activation-checkpointed,
ulysses on packed documents with every second layer checkpointed, and the interleaved schedule
(2 virtual stages per rank, 8 layers).  The layout is the one the composition gives: each pp rank
holds its stages' parameters only (the embedding on the first, the final norm and ``lm_head`` on
the last), every one sharded over fsdp = dp_shard * cp = 2 ranks, and the CP groups are the two
ranks of each stage.  A pp=2 x cp=2 checkpoint resumes at pp=1 (cp=2 x dp_shard=2) on the
one-process loss curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from train_reference import single_process_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

STEPS = 3
# A resume from step 2 runs two more steps: the last one's loss depends on the restored moments.
RESUMED_STEPS = 4
# 32 tokens: over cp=2 chunks of 8, each holding parts of packed documents (4 to 20 tokens)
SHORT = ["--seq-len", "32", "--lr", "1e-2", "--checkpoint-every", "100", "--steps", str(STEPS)]
PARALLELISM = {"data_parallel_shard": 1, "tensor_parallel": 1, "context_parallel": 2,
               "context_parallel_method": "colossal", "pipeline_parallel": 2,
               "pipeline_parallel_layers_per_stage": "auto"}
# 8 rows, 2 per microbatch: 4 microbatches through the 1F1B schedule
TRAINING = {"global_batch_size": 8, "local_batch_size": 2}
CAUSAL = {"model": {"use_attn_mask_compression": True}}
PACKED = {"train_dataset": {"dataloader": {"config": {"create_compressed_eod_mask": True,
                                                   "create_attention_mask": False}}}}


def _job(tmp_path: Path, data: dict[str, Any], method: str, interleave: int = 1) -> str:
    path = tmp_path / "job.yaml"
    parallelism = {**PARALLELISM, "context_parallel_method": method, "pipeline_parallel_interleave_num": interleave}
    if method == "ulysses":
        parallelism["ulysses_degree_in_cp"] = 2
    job = {"parallelism": parallelism, "training": TRAINING, **data}
    if interleave > 1:  # 2 layers per virtual stage
        job["model"] = {**job.get("model", {}), "num_hidden_layers": 4 * interleave}
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _train_and_describe(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """This rank's stage parameters, activation-checkpointed layers and CP group as the trainer
    builds them, then its losses."""
    from hp_models.activation_checkpoint import is_checkpointed

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    model, dp_rank = train.build_model(args, layout, config, distributed=True)
    shares = {name: (tuple(p.shape), tuple(p.to_local().shape), tuple(p.device_mesh.shape))
              for name, p in model.named_parameters()}
    cp = {"ranks": tuple(model.cp.mesh.group_ranks(0)), "rank": model.cp.rank, "size": model.cp.cp}
    checkpointed = sorted(int(i) for i, layer in model.model.layers.items() if is_checkpointed(layer))
    del model
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"layout": layout.as_dict(), "shares": shares, "cp": cp, "dp_rank": dp_rank, "losses": out["losses"],
            "checkpointed": checkpointed,
            "describe": layout.describe()}


def _stage_of(name: str, stages: list[list[int]]) -> int:
    """The pp rank holding parameter ``name`` when virtual stage ``v`` holds layers ``stages[v]``
    (virtual stage ``v`` runs on pp rank ``v % 2``)."""
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(v for v, layers in enumerate(stages) if layer in layers) % 2
    return (len(stages) - 1) % 2  # model.norm, lm_head: the last stage


@pytest.mark.parametrize("data,method,flags,interleave", [
    (CAUSAL, "colossal", [], 1),
    (PACKED, "colossal", ["--activation-checkpoint", "full"], 1),
    (PACKED, "ulysses", ["--activation-checkpoint", "selective", "--ac-every", "2"], 1),
    (CAUSAL, "colossal", [], 2),
], ids=["colossal-causal", "colossal-packed-eod-ac-full", "ulysses-packed-eod-ac-selective",
        "colossal-causal-interleaved"])
def test_pp2_cp2_equals_one_process(pool4: RankPool, data: dict[str, Any], method: str, flags: list[str],
                                    interleave: int, tmp_path) -> None:
    import torch

    argv = ["--job", _job(tmp_path, data, method, interleave), *flags, *SHORT]
    res = pool4.run(_train_and_describe, [*argv, "--out-dir", str(tmp_path / "run")])
    layout = res[0]["layout"]
    stages = [[2 * v, 2 * v + 1] for v in range(2 * interleave)]
    for key, value in {"world_size": 4, "pp": 2, "interleave": interleave, "cp": 2, "cp_method": method, "tp": 1,
                       "dp_shard": 1, "accumulation_steps": 4, "stage_layers": stages}.items():
        assert layout[key] == value, (key, layout)
    # ranks (pp, cp) row-major: pp rank 0 holds ranks 0 and 1, its CP group
    assert [r["cp"] for r in res] == [{"ranks": (0, 1), "rank": 0, "size": 2}, {"ranks": (0, 1), "rank": 1, "size": 2},
                                      {"ranks": (2, 3), "rank": 0, "size": 2}, {"ranks": (2, 3), "rank": 1, "size": 2}]
    assert [r["dp_rank"] for r in res] == [0, 0, 0, 0]
    # the job's layers by their index in the whole model (selective every 2nd: layers 1 and 3)
    want = {"full": [0, 1, 2, 3], "selective": [1, 3]}.get(flags[1] if flags else "", [])
    assert sorted({i for r in res for i in r["checkpointed"]}) == want
    names = {rank: set(res[rank]["shares"]) for rank in range(4)}
    assert names[0] == names[1] and names[2] == names[3] and not names[0] & names[2]
    assert all(_stage_of(n, stages) == 0 for n in names[0]) and all(_stage_of(n, stages) == 1 for n in names[2])
    held = {int(n.split(".")[2]) for n in names[0] if n.startswith("model.layers.")}
    assert held == {i for v in range(0, len(stages), 2) for i in stages[v]}, held
    assert "model.embed_tokens.weight" in names[0] and {"model.norm.weight", "lm_head.weight"} <= names[2]
    for rank, r in enumerate(res):
        for name, (whole, local, mesh) in r["shares"].items():
            assert mesh == (2,), (name, mesh)  # fsdp = dp_shard * cp
            rows = [len(c) for c in torch.chunk(torch.arange(whole[0]), 2)] + [0]
            assert local == (rows[rank % 2], *whole[1:]), (rank, name, whole, local)
    assert all(r["losses"] == res[0]["losses"] for r in res)  # every rank reports the same losses
    single = single_process_run(argv, tmp_path / "single")["losses"]
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(single), rtol=1.5e-4, atol=1e-5)
    worst = max(abs(a - b) / abs(b) for a, b in zip(res[0]["losses"], single))
    print(f"\n[train pp x cp] {res[0]['describe']} ({'packed' if data is PACKED else 'causal'}): losses "
          f"{res[0]['losses']}\n  one process {single}\n  max rel diff {worst:.2e}")


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "start": out["start_step"], "describe": layout.describe()}


def test_checkpoint_reshards_from_pp2_cp2_to_cp2_dp2(pool4: RankPool, tmp_path) -> None:
    """pp=2 x cp=2 saves at step 2; cp=2 x dp_shard=2 without a pipeline resumes to step 4 on the
    one-process curve (a checkpoint keeps the whole model's names under every layout)."""
    import torch

    job = _job(tmp_path, CAUSAL, "colossal")
    steps = ["--steps", str(RESUMED_STEPS)]
    part = pool4.run(_run, ["--job", job, *SHORT, "--steps", "2", "--out-dir", str(tmp_path / "run")])
    resumed = pool4.run(_run, ["--job", job, "--pp", "1", "--dp-shard", "2", *SHORT, *steps, "--out-dir",
                               str(tmp_path / "run"), "--resume"])
    assert resumed[0]["start"] == 2 and resumed[0]["losses"][:2] == part[0]["losses"]
    assert len(resumed[0]["losses"]) == RESUMED_STEPS
    single = single_process_run(["--job", job, *SHORT, *steps], tmp_path / "single")["losses"]
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(single), rtol=1.5e-4, atol=1e-5)
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed[0]["losses"], single))
    print(f"\n[train pp x cp checkpoint] {part[0]['describe']} saved step 2, {resumed[0]['describe']} resumed to "
          f"{RESUMED_STEPS}: max rel diff vs one process {worst:.2e}")


def test_microbatch_facts_follow_the_plan_and_fail_closed() -> None:
    """Each stage takes its microbatches' facts in the order the plan runs its forwards; a stage
    that runs more forwards than planned, or a step that ends short, is an error."""
    from types import SimpleNamespace

    from hp_models.qwen3_5.context_parallel import SequenceFacts
    from hp_models.qwen3_5.pipeline_cp import MicrobatchFacts
    from hp_pp import ScheduleKind, build_plan

    plan = build_plan(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 4)  # pp 2, 4 microbatches, 4 virtual stages
    first, third = object(), object()
    stages = [SimpleNamespace(stage_index=0, module=first), SimpleNamespace(stage_index=2, module=third)]
    facts = MicrobatchFacts()
    facts.follow(stages, plan.rank_actions(0))
    mb = [SequenceFacts(seq_len=8 * (i + 1)) for i in range(4)]
    facts.start(mb)
    order = [(a.stage, a.microbatch) for a in plan.rank_actions(0) if a.kind.value == "F"]
    assert sorted(order) == [(v, m) for v in (0, 2) for m in range(4)]
    for v, m in order:
        assert facts.take(first if v == 0 else third) is mb[m]
    facts.finish()
    with pytest.raises(RuntimeError, match="ran forward 5 of a step whose plan has 4"):
        facts.take(first)
    facts.start(mb)
    facts.take(first)
    with pytest.raises(RuntimeError, match="ran 1 of 4, 0 of 4 planned forwards"):
        facts.finish()
    with pytest.raises(RuntimeError, match="not one of the stages"):
        facts.take(object())
