# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The MoE trainer under context parallelism on 4 gloo ranks: the tiny MoE model at cp=2 x
dp_shard=2 with ep=2 (colossal) and ep=4 (experts spread over the CP and data-parallel ranks),
ulysses cp=4 with ep=2 and hybrid cp=4 (ulysses 2) with ep=4, report the losses of the same run on one process (the trainer's
``--compare-single`` reference: the router loss of each forward's whole sequences) and the same
tokens per expert in every layer and step.  What MoE + CP cannot run (packed documents, also
with TP) is refused before any rank starts; MoE + CP + TP is ``test_train_moe_cp_tp``."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from train_reference import single_process_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

STEPS = 3
SHORT = ["--config", "tiny-moe", "--nproc", "4", "--steps", str(STEPS), "--seq-len", "32", "--lr", "1e-2",
         "--checkpoint-every", "100"]
CAUSAL = {"model": {"use_attn_mask_compression": True}}
TRAINING = {"global_batch_size": 8, "local_batch_size": 2}


def _job(tmp_path, parallelism: dict[str, Any], **extra: Any) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"parallelism": {"tensor_parallel": 1, **parallelism}, "training": TRAINING,
                                    **extra}))
    return str(path)


def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank, and the share of the experts' elements it holds."""
    from hp_dtensor import DTensor

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    trained = train.fit(args, layout, config, rank, distributed=True, quiet=True)
    experts = [p for name, p in trained.model.named_parameters() if ".experts." in name]
    assert all(isinstance(p, DTensor) for p in experts)
    held = sum(p.to_local().numel() for p in experts) / sum(p.numel() for p in experts)
    cp = trained.model.context_parallel
    return {"losses": trained.result["losses"], "load": trained.result["tokens_per_expert"],
            "layout": layout.as_dict(), "describe": layout.describe(), "expert_share": held,
            "cp_ranks": tuple(cp.mesh.group_ranks(cp.mesh.ndim - 1))}


@pytest.mark.parametrize("parallelism,layout,cp_ranks", [
    ({"context_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2},
     {"cp": 2, "cp_method": "colossal", "dp_shard": 2, "ep": 2, "efsdp": 2, "accumulation_steps": 2},
     [(0, 1), (0, 1), (2, 3), (2, 3)]),
    ({"context_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 4},
     {"cp": 2, "dp_shard": 2, "ep": 4, "efsdp": 1, "accumulation_steps": 2}, [(0, 1), (0, 1), (2, 3), (2, 3)]),
    ({"context_parallel": 4, "context_parallel_method": "ulysses", "ulysses_degree_in_cp": 4,
      "data_parallel_shard": 1, "expert_parallel": 2},
     {"cp": 4, "cp_method": "ulysses", "dp_shard": 1, "ep": 2, "efsdp": 2, "accumulation_steps": 4},
     [(0, 1, 2, 3)] * 4),
    # hybrid: rings of 2 across ulysses groups of 2; the router statistics over all 4 CP ranks
    ({"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 2,
      "data_parallel_shard": 1, "expert_parallel": 4},
     {"cp": 4, "cp_method": "hybrid", "ulysses_degree": 2, "ep": 4, "efsdp": 1}, [(0, 1), (0, 1), (2, 3), (2, 3)]),
], ids=["colossal-cp2-dp2-ep2", "colossal-cp2-dp2-ep4", "ulysses-cp4-ep2", "hybrid-cp4-u2-ep4"])
def test_moe_cp_equals_one_process(pool4: RankPool, parallelism: dict[str, Any], layout: dict[str, Any],
                                   cp_ranks: list[tuple[int, ...]], tmp_path) -> None:
    import torch

    argv = ["--job", _job(tmp_path, parallelism, **CAUSAL), *SHORT]
    res = pool4.run(_run, [*argv, "--out-dir", str(tmp_path / "run")])
    for key, value in layout.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    assert [r["cp_ranks"] for r in res] == cp_ranks
    # the experts over ep and efsdp: every rank holds 1 / (ep * efsdp) = 1 / 4 of their elements
    assert all(r["expert_share"] == 0.25 for r in res), [r["expert_share"] for r in res]
    assert all(r["losses"] == res[0]["losses"] and r["load"] == res[0]["load"] for r in res)
    single = single_process_run(argv, tmp_path / "single")
    load = res[0]["load"]
    # 8 samples x 32 tokens x top-2 routed copies per layer and step, each counted once
    assert load["copies_per_step"] == 8 * 32 * 2
    assert load["per_step"] == single["tokens_per_expert"]["per_step"], "tokens per expert differ from one process"
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(single["losses"]), rtol=1.5e-4,
                               atol=1e-5)
    worst = max(abs(a - b) / abs(b) for a, b in zip(res[0]["losses"], single["losses"]))
    print(f"\n[train moe cp] {res[0]['describe']}: losses {res[0]['losses']}\n  one process {single['losses']}\n"
          f"  max rel diff {worst:.2e}; tokens per expert equal to one process in all {STEPS} steps")


PACKED = {"train_dataset": {"dataloader": {"config": {"create_compressed_eod_mask": True,
                                                      "create_attention_mask": False}}}}


@pytest.mark.parametrize("parallelism,extra,words", [
    ({"context_parallel": 2, "data_parallel_shard": 2}, PACKED,
     ["packed documents", "with context_parallel=2", "not built for the MoE model", "use_attn_mask_compression"]),
    ({"context_parallel": 2, "tensor_parallel": 2}, PACKED,
     ["packed documents", "with context_parallel=2", "not built for the MoE model", "use_attn_mask_compression"]),
    # without CP too: the MoE step used to train the packed rows whole, across document ends
    ({"data_parallel_shard": 2}, PACKED,
     ["packed documents (create_compressed_eod_mask: true) are not built for the MoE model", "cross document ends",
      "create_compressed_eod_mask: false"]),
], ids=["packed-documents", "packed-documents-with-tp", "packed-documents-no-cp"])
def test_bad_moe_cp_job_fails_before_any_rank_starts(parallelism, extra, words, tmp_path) -> None:
    job = _job(tmp_path, parallelism, **extra)
    with pytest.raises(SystemExit) as info:
        train.main(["--job", job, *SHORT, "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()
