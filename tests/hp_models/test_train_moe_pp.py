# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The MoE trainer under pipeline parallelism on 4 gloo ranks: the tiny MoE model cut into 2
stages of 2 layers, with dp_shard=2 and ep=2, with tp=2 and ep=2 (sequence-parallel activations
between the stages; full activation checkpointing), with tp=2 and ep=1 (each expert TP-split over
etp=2), interleaved (2 virtual stages per rank, one layer each) with dp_shard=2 and ep=2, and
with context parallelism inside the stages (colossal cp=2 with ep=2, ulysses cp=2 with the
experts sharded over the CP ranks and selective activation checkpointing).
The router's load-balancing loss combines every layer's routing, so each microbatch's
statistics travel with its activations and the gradient back with theirs.  Each run reports the
losses of the same run on one process and the same tokens per expert in every layer and step,
and each rank holds its share of its own stage's parameters only.  A checkpoint saved under the
pipeline resumes without it on the one-process curve."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from moe_shares import EP, check_equals_one_process, check_shares, train_and_hold
from train_reference import single_process_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

STEPS = 3
SEQ = 32
SHORT = ["--config", "tiny-moe", "--nproc", "4", "--steps", str(STEPS), "--seq-len", str(SEQ), "--lr", "1e-2",
         "--checkpoint-every", "100"]
PP = {"pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": "auto"}
TP_EXPECT = {"model.layers.0.mlp.gate.weight": ("R",), "model.layers.0.mlp.shared_expert.down_proj.weight": ("S(1)",),
             "lm_head.weight": ("S(0)",)}
FSDP_EXPECT = {"model.layers.0.mlp.gate.weight": ("S(0)",), "lm_head.weight": ("S(0)",)}
EP_ALONE = {"gate_proj": (("ep",), ("S(0)",)), "down_proj": (("ep",), ("S(0)",))}


def _job(tmp_path, parallelism: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    causal = {"model": {"use_attn_mask_compression": True}} if "context_parallel" in parallelism else {}
    path.write_text(yaml.safe_dump({"parallelism": {**PP, **parallelism},
                                    "training": {"global_batch_size": 8, "local_batch_size": 2}, **causal}))
    return str(path)


@pytest.mark.parametrize("parallelism,flags,layout,experts,dense,expect", [
    ({"tensor_parallel": 1, "data_parallel_shard": 2, "expert_parallel": 2}, [],
     {"pp": 2, "dp_shard": 2, "ep": 2, "efsdp": 1, "stage_layers": [[0, 1], [2, 3]]}, EP, ("fsdp",), FSDP_EXPECT),
    ({"tensor_parallel": 2, "expert_parallel": 2}, ["--activation-checkpoint", "full"],
     {"pp": 2, "tp": 2, "ep": 2, "efsdp": 1, "activation_checkpoint": "full"}, EP_ALONE, ("tp",), TP_EXPECT),
    ({"tensor_parallel": 2, "expert_parallel": 1}, [], {"pp": 2, "tp": 2, "etp": 2, "edp": 1},
     {"gate_proj": (("ep", "etp"), ("S(0)", "S(1)")), "down_proj": (("ep", "etp"), ("S(0)", "S(2)"))}, ("tp",),
     TP_EXPECT),
    ({"tensor_parallel": 1, "data_parallel_shard": 2, "expert_parallel": 2, "pipeline_parallel_interleave_num": 2},
     [], {"pp": 2, "interleave": 2, "stage_layers": [[0], [1], [2], [3]], "ep": 2}, EP, ("fsdp",), FSDP_EXPECT),
    # context parallelism inside the stages: each CP rank's share of the hidden states and of the
    # statistics travels; the router loss sums the statistics over the CP group
    ({"tensor_parallel": 1, "context_parallel": 2, "data_parallel_shard": 1, "expert_parallel": 2}, [],
     {"pp": 2, "cp": 2, "cp_method": "colossal", "ep": 2, "efsdp": 1}, EP, ("fsdp",), FSDP_EXPECT),
    ({"tensor_parallel": 1, "context_parallel": 2, "context_parallel_method": "ulysses", "ulysses_degree_in_cp": 2,
      "data_parallel_shard": 1, "expert_parallel": 1}, ["--activation-checkpoint", "selective"],
     {"pp": 2, "cp": 2, "cp_method": "ulysses", "activation_checkpoint": "selective every 2"},
     {"gate_proj": (("efsdp",), ("S(0)",))}, ("fsdp",), FSDP_EXPECT),
], ids=["pp2-dp2-ep2", "pp2-tp2-ep2-full-ac", "pp2-tp2-etp2", "interleaved-pp2x2-dp2-ep2", "pp2-cp2-ep2",
        "pp2-ulysses-cp2-selective-ac"])
def test_moe_pp_equals_one_process(pool4: RankPool, parallelism: dict[str, Any], flags: list[str],
                                   layout: dict[str, Any], experts: dict[str, Any], dense: tuple[str, ...],
                                   expect: dict[str, tuple[str, ...]], tmp_path) -> None:
    argv = ["--job", _job(tmp_path, parallelism), *SHORT, *flags]
    res = pool4.run(train_and_hold, [*argv, "--out-dir", str(tmp_path / "run")])
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    params = [r["params"] for r in res]
    check_shares(params, experts, dense_dims=dense, expect=expect)
    # pp rank 0 (ranks 0 and 1 of the dense mesh [pp, dp_replicate, fsdp, tp]) holds the first
    # stage's layers and the embedding, pp rank 1 the others and the head
    first = res[0]["layout"]["stage_layers"][0]
    for rank, held in enumerate(params):
        layers = sorted({int(n.split(".")[2]) for n in held if n.startswith("model.layers.")})
        mine = [i for v, ls in enumerate(res[0]["layout"]["stage_layers"]) if v % 2 == rank // 2 for i in ls]
        assert layers == mine and ("lm_head.weight" in held) == (rank >= 2), (rank, layers, first)
    check_equals_one_process(res, argv, tmp_path / "single", SEQ, "train moe pp")


def _losses(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    result = train.fit(args, layout, config, rank, distributed=True, quiet=True).result
    return {"losses": result["losses"], "start": result["start_step"], "describe": layout.describe()}


def test_moe_checkpoint_of_a_pipeline_resumes_without_one(pool4: RankPool, tmp_path) -> None:
    """pp=2 x dp_shard=2 x ep=2 saves at step 2 (each stage's ranks their layers' experts and
    dense shards) and dp_shard=4 x ep=2 resumes to step 3, on the one-process curve."""
    out = tmp_path / "run"
    pp = ["--job", _job(tmp_path, {"tensor_parallel": 1, "data_parallel_shard": 2, "expert_parallel": 2}), *SHORT]
    part = pool4.run(_losses, [*pp, "--steps", "2", "--out-dir", str(out)])
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"parallelism": {"tensor_parallel": 1, "data_parallel_shard": 4, "expert_parallel": 2},
                                    "training": {"global_batch_size": 8, "local_batch_size": 2}}))
    resumed = pool4.run(_losses, ["--job", str(flat), *SHORT, "--out-dir", str(out), "--resume"])
    assert resumed[0]["start"] == 2 and resumed[0]["losses"][:2] == part[0]["losses"]
    straight = single_process_run(pp, tmp_path / "single")["losses"]
    import torch

    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(straight), rtol=1.5e-4, atol=1e-5)
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed[0]["losses"], straight))
    print(f"\n[train moe pp checkpoint] {part[0]['describe']} saved step 2, {resumed[0]['describe']} resumed to "
          f"{STEPS}: max rel diff to one process {worst:.2e}")


@pytest.mark.parametrize("parallelism,flags,words", [
    ({"tensor_parallel": 1, "data_parallel_shard": 2, "expert_parallel": 2}, ["--mixed-precision", "bf16"],
     ["pipeline_parallel=2 with param_dtype bfloat16", "exact in float32 only"]),
], ids=["bf16"])
def test_bad_moe_pp_job_fails_before_any_rank_starts(parallelism, flags, words, tmp_path) -> None:
    job = _job(tmp_path, parallelism)
    with pytest.raises(SystemExit) as info:
        train.main(["--job", job, *SHORT, *flags, "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()
