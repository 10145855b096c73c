# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The trainer with a job file on 4 gloo ranks: FSDP + TP (dp_shard=2, tp=2, two accumulation
micro-steps, gradients summed; 5 steps) and HSDP (2 replicas x 2 shards, gradients averaged, no
reshard after forward; 3 steps) give the loss curve of plain single-process training on the same
global batches, and the gradients of its first step; a run stopped at step 3 resumes to the same
losses; degrees that are not built, expert parallelism of the dense model, and bad batch sizes fail before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train
from hp_models.job import ModelSizes, Overrides, plan

pool4 = rank_pool_fixture(4, timeout=300)

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "qwen3_5_fsdp_tp.yaml")
STEPS = 5
SHORT = ["--steps", str(STEPS), "--seq-len", "16", "--lr", "1e-2", "--checkpoint-every", "100"]
TINY = ModelSizes(num_attention_heads=8, num_hidden_layers=4)
HSDP_JOB = """
parallelism:
  data_parallel_shard: 2
  tensor_parallel: 1
  reshard_after_forward_policy: never
  disable_gradient_division: False
training:
  global_batch_size: 8
  local_batch_size: 2
"""


# ---------------------------------------------------------------- the reference: one process
def _reference(steps: int, batch: int, seq_len: int, lr: float) -> tuple[list[float], dict[str, Any]]:
    """Plain torch: the model as the trainer seeds it, AdamW, the mean loss over each whole batch."""
    import torch
    import torch.nn.functional as F

    from hp_models import synthetic
    from hp_models.qwen3_5 import tiny_config

    cfg = tiny_config()
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, first_grads = [], {}
    for step in range(steps):
        ids, tgt = synthetic.batch(0, step, batch, seq_len, cfg.vocab_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first_grads


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, Any]]:
    return _reference(STEPS, 8, 16, 1e-2)


# ---------------------------------------------------------------- on the ranks
def _run(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank: parse, check, train."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict(), "start": out["start_step"]}


def _first_step_grads(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """The gradients one ``train_step`` leaves for the optimizer, gathered whole (rank 0 returns them)."""
    from hp_models import synthetic

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    model, dp_rank = train.build_model(args, layout, config, distributed=True)
    ids, tgt = synthetic.batch(args.seed, 0, layout.global_batch_size, args.seq_len, config.vocab_size)
    train.train_step(model, layout, dp_rank, ids, tgt, tp_loss=layout.tp > 1)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    # every parameter is sharded over the data-parallel ranks (on top of its TP placement, if any)
    dp_sharded = sum(1 for p in model.parameters() if str(p.placements[-1]) in ("Shard(dim=0)", "S(0)"))
    return {"grads": grads, "dp_sharded": dp_sharded, "placements": {n: str(p.placements) for n, p in model.named_parameters()}} if rank == 0 else None


def _check_against_reference(res: list[dict[str, Any]], reference: tuple[list[float], dict[str, Any]]) -> float:
    import torch

    ref_losses = reference[0]
    worst = 0.0
    for r in res:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1.5e-4, atol=1e-5)
        worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)))
    return worst


def _check_grads(got: dict[str, Any], reference: tuple[list[float], dict[str, Any]]) -> float:
    import torch

    ref = reference[1]
    assert set(got) == set(ref)
    worst = 0.0
    for name, g in got.items():
        # fp32 sums in another order: relative to the tensor's scale, as the TP tests do
        torch.testing.assert_close(g, ref[name], rtol=1e-3, atol=1e-5, msg=name)
        worst = max(worst, float((g - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-12)))
    return worst


def _fsdp_tp_argv(out: Path, *extra: str) -> list[str]:
    return ["--job", EXAMPLE, "--nproc", "4", "--out-dir", str(out), *SHORT, *extra]


@pytest.fixture(scope="module")
def fsdp_tp_run(pool4: RankPool, tmp_path_factory) -> list[dict[str, Any]]:
    return pool4.run(_run, _fsdp_tp_argv(tmp_path_factory.mktemp("fsdp_tp")), timeout=300)


def test_fsdp_tp_job_equals_single_process(pool4: RankPool, fsdp_tp_run, reference, tmp_path) -> None:
    res = fsdp_tp_run
    assert res[0]["layout"] == {
        "world_size": 4, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "global_batch_size": 8, "local_batch_size": 2,
        "accumulation_steps": 2, "sum_gradients": True, "reshard_after_forward": True,
    }
    worst = _check_against_reference(res, reference)
    print(f"\nFSDP+TP 2x2, {STEPS} steps: ours {res[0]['losses']}\n  single {reference[0]}\n  max rel diff {worst:.2e}")
    grads = pool4.run(_first_step_grads, _fsdp_tp_argv(tmp_path), timeout=300)[0]
    assert grads["dp_sharded"] == len(reference[1]), grads["placements"]
    print(f"  step-1 gradients: max diff / max |grad| = {_check_grads(grads['grads'], reference):.2e}")


def test_fsdp_tp_resume_gives_the_same_losses(pool4: RankPool, fsdp_tp_run, tmp_path) -> None:
    """Stopped after 3 steps and resumed to 5: the losses of the straight run, bit for bit (the
    checkpoint's HF tensors are read back into parameters sharded by TP and then by FSDP)."""
    pool4.run(_run, _fsdp_tp_argv(tmp_path, "--steps", "3"))
    resumed = pool4.run(_run, _fsdp_tp_argv(tmp_path, "--resume"))
    assert resumed[0]["start"] == 3 and resumed[0]["losses"] == fsdp_tp_run[0]["losses"]


def test_hsdp_job_equals_single_process(pool4: RankPool, reference, tmp_path) -> None:
    job = tmp_path / "hsdp.yaml"
    job.write_text(HSDP_JOB)
    argv = ["--job", str(job), "--nproc", "4", "--out-dir", str(tmp_path), *SHORT, "--steps", "3"]
    res = pool4.run(_run, argv, timeout=300)
    assert res[0]["layout"] == {
        "world_size": 4, "dp_replicate": 2, "dp_shard": 2, "tp": 1, "global_batch_size": 8, "local_batch_size": 2,
        "accumulation_steps": 1, "sum_gradients": False, "reshard_after_forward": False,
    }
    worst = _check_against_reference(res, (reference[0][:3], reference[1]))
    print(f"\nHSDP 2x2, 3 steps: ours {res[0]['losses']}\n  max rel diff {worst:.2e}")
    grads = pool4.run(_first_step_grads, [*argv, "--overwrite"], timeout=300)[0]  # the run above left its checkpoint
    print(f"  step-1 gradients: max diff / max |grad| = {_check_grads(grads['grads'], reference):.2e}")


# ---------------------------------------------------------------- before any rank starts
@pytest.mark.parametrize("parallelism,words", [
    ({"context_parallel": 2}, ["requires a compressed attention mask", "use_attn_mask_compression"]),
    ({"pipeline_parallel": 2}, ["pipeline_parallel > 1 needs pipeline_parallel_layers_per_stage", "'auto'"]),
    ({"expert_parallel": 2}, ["expert_parallel=2 needs a mixture-of-experts model", "--config tiny-moe"]),
    ({"data_parallel_shard": 3}, ["data_parallel", "not divisible by data_parallel_shard 3"]),
    ({"reshard_after_forward_policy": "sometimes"}, ["reshard_after_forward_policy", "'sometimes'"]),
    ({"tensor_paralel": 2}, ["unknown key(s) 'tensor_paralel' (did you mean 'tensor_parallel'?) in parallelism"]),
])
def test_bad_parallelism_fails_before_any_rank_starts(parallelism, words, tmp_path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"parallelism": {"tensor_parallel": 2, **parallelism}}))
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job), "--nproc", "4", "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,words", [
    (["--batch-size", "10"], ["global_batch_size 10 is not a multiple", "2 * 2 = 4"]),
    (["--batch-size", "2"], ["exceeds global_batch_size 2"]),
    (["--job", "/nonexistent/job.yaml"], ["job file '/nonexistent/job.yaml' does not exist"]),
    (["--nproc", "5"], ["world_size 5 is not divisible", "2*1*1"]),
])
def test_bad_batch_and_world_fail_before_any_rank_starts(argv, words) -> None:
    with pytest.raises(SystemExit) as info:
        train.main(["--job", EXAMPLE, *argv] if "--job" not in argv else argv)
    msg = str(info.value.code)
    assert all(w in msg for w in words), msg


def test_model_facts_in_the_job_must_match_the_model(tmp_path) -> None:
    job = tmp_path / "job.yaml"
    # (model.num_hidden_layers sets the depth of the tiny config; the head count is the config's)
    job.write_text("parallelism:\n  tensor_parallel: 2\nmodel:\n  num_attention_heads: 16\n")
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job)])
    assert "model.num_attention_heads is 16 but the model being trained has 8" in str(info.value.code)


# ---------------------------------------------------------------- the layout, one process
def test_example_job_and_overrides() -> None:
    from hp_models.job import read_job_file

    raw = read_job_file(EXAMPLE)
    lay = plan(raw, Overrides(), TINY)
    assert (lay.world_size, lay.dims.dp_shard, lay.tp, lay.accumulation) == (4, 2, 2, 2)
    assert lay.loss_scale() == 1 / 4  # summed over 2 data-parallel ranks, 2 micro-steps added
    assert [lay.samples(r, m) for m in range(2) for r in range(2)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    hsdp = plan(raw, Overrides(), TINY, world_size=8)  # more ranks: replicas
    assert (hsdp.dims.dp_replicate, hsdp.dims.dp_shard, hsdp.accumulation, hsdp.loss_scale()) == (2, 2, 1, 1 / 4)
    flags = plan(raw, Overrides(tp=1, dp_shard=4, global_batch_size=16, local_batch_size=1), TINY)
    assert (flags.world_size, flags.dims.dp_shard, flags.tp, flags.accumulation, flags.loss_scale()) == (4, 4, 1, 4, 1 / 16)
    averaged = plan({**raw, "parallelism": {**raw["parallelism"], "disable_gradient_division": False}}, Overrides(), TINY)
    assert averaged.loss_scale() == 1 / 2  # fully_shard averages; only the micro-steps are divided out
    default = plan(None, Overrides(), TINY)  # no job file: the README's main job
    assert (default.world_size, default.tp, default.dp, default.local_batch_size, default.loss_scale()) == (2, 2, 1, 8, 1.0)
    launched = plan(None, Overrides(), TINY, world_size=4)  # e.g. torchrun with 4 ranks
    assert (launched.dims.dp_shard, launched.local_batch_size, launched.accumulation) == (2, 4, 1)
