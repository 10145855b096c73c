# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""bf16 mixed precision from the job file in the trainer, on 4 gloo ranks.

dp_shard=2 x tp=2 with ``param_dtype: bfloat16``, ``reduce_dtype: float32`` (job file) trains like
a one-process plain-torch reference that applies FSDP2's casts by hand (float32 master weights and
AdamW; each step a bfloat16 copy computes forward and backward, the logits are cast to float32 for
the loss, the gradients cast back to float32): losses within one bf16 ulp, and decreasing.  The
mean loss hardly tells bf16 from float32 on this model, so the dtypes a step sees are checked too:
bf16 weights and activations in the blocks, float32 logits, master parameters and gradients.  With
dp_shard=4 (tp=1) the bytes ``fully_shard`` all-gathers halve under bf16 parameters, while the
reduce-scatter keeps float32 unless ``reduce_dtype`` is bfloat16 too (counted by CommDebugMode).
pp=2 x dp_shard=2 under bf16 equals the same reference: the stages exchange bf16 activations and
the last stage's logits are cast to float32 for the loss.  Context parallelism (colossal cp=2 x
dp_shard=2) and expert parallelism (the tiny MoE model at ep=2 x tp=2 x dp_shard=2) under bf16
equal the same casts on one process (for the MoE model per forward of the run's local batch, the
router loss included) within one bf16 ulp, with bf16 compute and float32 master weights and
gradients.  Mixed precision without data-parallel sharding is refused before any rank starts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

STEPS = 10
LR = 3e-3
SEQ = 32
SHORT = ["--steps", str(STEPS), "--seq-len", str(SEQ), "--lr", str(LR), "--checkpoint-every", "100"]
JOB = """
parallelism:
  data_parallel_shard: 2
  tensor_parallel: 2
training:
  global_batch_size: 8
  param_dtype: bfloat16
  reduce_dtype: float32
"""
# one bf16 ulp (2^-8, relative): the distributed run rounds its partial sums (TP's row-parallel
# reductions, the per-rank gradients) at other places than one process
LOSS_RTOL = 2**-8


def _reference(steps: int, batch: int, seq_len: int, lr: float, *, bf16: bool = True, moe: bool = False,
               per_forward: int | None = None) -> list[float]:
    """Plain torch on one process with FSDP2's mixed-precision casts applied by hand (``bf16``),
    or in float32 throughout; the tiny model, or the tiny MoE model (``moe``: its loss adds the
    weighted router loss).  Each step's batch runs in forwards of ``per_forward`` rows (default:
    one forward), each gradient cast to float32 and added there (the reduction's dtype)."""
    import torch
    import torch.nn.functional as F

    from hp_models import synthetic
    from hp_models.qwen3_5 import tiny_config
    from hp_models.qwen3_5_moe import tiny_moe_config

    cfg = tiny_moe_config() if moe else tiny_config()
    torch.manual_seed(0)
    master = cfg.build()
    master.init_weights()
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    rows = per_forward or batch
    forwards = batch // rows
    losses = []
    for step in range(steps):
        ids, tgt = synthetic.batch(0, step, batch, seq_len, cfg.vocab_size)
        work = copy.deepcopy(master)  # the all-gathered parameters, in param_dtype (buffers as they are)
        for p in work.parameters():
            p.data = p.data.to(torch.bfloat16 if bf16 else torch.float32)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        total = 0.0
        for k in range(forwards):
            part = slice(k * rows, (k + 1) * rows)
            loss = F.cross_entropy(work(ids[part]).float().flatten(0, 1), tgt[part].flatten())
            if moe:
                loss = loss + cfg.router_aux_loss_coef * work.aux_loss()
            (loss / forwards).backward()
            for g, w in zip(grads, work.parameters()):
                if w.grad is not None:
                    g += w.grad.float()  # reduced in float32
                    w.grad = None
            total += loss.item()
        opt.zero_grad()
        for p, g in zip(master.parameters(), grads):
            p.grad = g  # stepped on the float32 master weights
        opt.step()
        losses.append(total / forwards)
    return losses


def _train(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict(), **_dtypes_seen(args, layout, config)}


def _dtypes_seen(args: Any, layout: Any, config: Any) -> dict[str, Any]:
    """The dtypes of one training step of the trainer's model: the sharded (master) parameters
    and their gradients, what a decoder layer's MLP computes with, and the logits."""
    from hp_models import synthetic

    model, dp_rank = train.build_model(args, layout, config, distributed=True)
    seen: dict[str, str] = {}
    block = model.model.layers[0].mlp
    mlp = block.down_proj if hasattr(block, "down_proj") else block.shared_expert.down_proj

    def record(module: Any, inputs: Any, output: Any) -> None:
        seen.update(mlp_input=str(inputs[0].dtype), mlp_weight=str(module.weight.dtype))

    mlp.register_forward_hook(record)
    model.register_forward_hook(lambda _m, _i, out: seen.update(logits=str(out.dtype)))
    model.model.layers[0].mlp.register_forward_hook(lambda _m, i, _o: seen.update(layer_input=str(i[0].dtype)))
    ids, tgt = synthetic.batch(args.seed, 0, layout.global_batch_size, args.seq_len, config.vocab_size)
    train.train_step(model, layout, dp_rank, ids, tgt, tp_loss=layout.tp > 1)
    seen["master"] = ",".join(sorted({str(p.dtype) for p in model.parameters()}))
    seen["grads"] = ",".join(sorted({str(p.grad.dtype) for p in model.parameters()}))
    return seen


def test_bf16_fsdp_tp_matches_one_process_casts(pool4: RankPool, tmp_path: Path) -> None:
    import torch

    job = tmp_path / "bf16.yaml"
    job.write_text(JOB)
    res = pool4.run(_train, ["--job", str(job), "--nproc", "4", "--out-dir", str(tmp_path), *SHORT], timeout=300)
    got = res[0]["losses"]
    assert all(r["losses"] == got for r in res)
    assert res[0]["layout"]["param_dtype"] == "bfloat16" and res[0]["layout"]["reduce_dtype"] == "float32"
    # bf16 compute on float32 master weights and gradients; the loss sees float32 logits
    assert {k: res[0][k] for k in ("master", "grads", "mlp_weight", "mlp_input", "logits")} == {
        "master": "torch.float32", "grads": "torch.float32", "mlp_weight": "torch.bfloat16",
        "mlp_input": "torch.bfloat16", "logits": "torch.float32"}, res[0]
    want = _reference(STEPS, 8, SEQ, LR)
    fp32 = _reference(STEPS, 8, SEQ, LR, bf16=False)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"\nbf16 dp_shard=2 x tp=2, {STEPS} steps: {[round(x, 4) for x in got]}\n"
          f"  1-process bf16 casts: {[round(x, 4) for x in want]}\n  max rel diff {worst:.2e}\n"
          f"  (1-process float32: {[round(x, 4) for x in fp32]}, max rel diff "
          f"{max(abs(a - b) / abs(b) for a, b in zip(got, fp32)):.2e})")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0.0)
    # it trains: each step draws a new batch, so the losses are noisy; compare the ends' means
    assert sum(got[-3:]) / 3 < sum(got[:3]) / 3 - 0.5, got


CP2 = """
model: {use_attn_mask_compression: true}
parallelism: {data_parallel_shard: 2, context_parallel: 2, tensor_parallel: 1}
training: {global_batch_size: 8, local_batch_size: 4, param_dtype: bfloat16}
"""
EP2 = """
parallelism: {tensor_parallel: 2, expert_parallel: 2, disable_gradient_division: false}
training: {global_batch_size: 8, local_batch_size: 4, param_dtype: bfloat16}
"""
CP_EP_STEPS = 6


@pytest.mark.parametrize("job,flags,layout,moe", [
    (CP2, [], {"cp": 2, "dp_shard": 2, "accumulation_steps": 1}, False),
    (EP2, ["--config", "tiny-moe"], {"ep": 2, "tp": 2, "dp_shard": 2, "efsdp": 2, "accumulation_steps": 1}, True),
], ids=["cp2-dp2", "ep2-tp2-dp2-moe"])
def test_bf16_cp_and_ep_match_one_process_casts(pool4: RankPool, job: str, flags: list[str],
                                                layout: dict[str, Any], moe: bool, tmp_path: Path) -> None:
    import torch

    path = tmp_path / "job.yaml"
    path.write_text(job)
    argv = ["--job", str(path), "--nproc", "4", "--out-dir", str(tmp_path), *flags, *SHORT,
            "--steps", str(CP_EP_STEPS)]
    res = pool4.run(_train, argv, timeout=300)
    got = res[0]["losses"]
    assert all(r["losses"] == got for r in res)
    assert all(res[0]["layout"][k] == v for k, v in layout.items()) and res[0]["layout"]["param_dtype"] == "bfloat16"
    for r in res:  # bf16 compute in the blocks (the MoE block's input), float32 master weights, gradients, logits
        assert {k: r[k] for k in ("master", "grads", "mlp_weight", "mlp_input", "layer_input", "logits")} == {
            "master": "torch.float32", "grads": "torch.float32", "mlp_weight": "torch.bfloat16",
            "mlp_input": "torch.bfloat16", "layer_input": "torch.bfloat16", "logits": "torch.float32"}, r
    want = _reference(CP_EP_STEPS, 8, SEQ, LR, moe=moe, per_forward=4 if moe else None)
    fp32 = _reference(CP_EP_STEPS, 8, SEQ, LR, bf16=False, moe=moe, per_forward=4 if moe else None)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"\nbf16 {'/'.join(f'{k}={v}' for k, v in layout.items())}, {CP_EP_STEPS} steps: "
          f"{[round(x, 4) for x in got]}\n  1-process bf16 casts: {[round(x, 4) for x in want]}\n"
          f"  max rel diff {worst:.2e} (vs 1-process float32: "
          f"{max(abs(a - b) / abs(b) for a, b in zip(got, fp32)):.2e})")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0.0)


def _train_pp(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict(), **_pp_dtypes_seen(args, layout, config)}


def _pp_dtypes_seen(args: Any, layout: Any, config: Any) -> dict[str, Any]:
    """The dtypes of one pipelined training step on this rank: what its first decoder layer's MLP
    computes with, the activations the stages exchange (as the schedule describes them), the
    logits the last stage hands to the loss and the loss itself, the master parameters and their
    gradients."""
    from hp_models import synthetic

    model, dp_rank = train.build_model(args, layout, config, distributed=True)
    seen: dict[str, str] = {}
    mlp = next(iter(model.model.layers.values())).mlp.down_proj

    def record(module: Any, inputs: Any, output: Any) -> None:
        seen.update(mlp_input=str(inputs[0].dtype), mlp_weight=str(module.weight.dtype))

    mlp.register_forward_hook(record)
    loss_fn = model.schedule.loss_fn

    def loss(logits: Any, target: Any) -> Any:
        value = loss_fn(logits, target)
        seen.update(stage_logits=str(logits.dtype), loss=str(value.dtype))
        return value

    model.schedule.loss_fn = loss
    ids, tgt = synthetic.batch(args.seed, 0, layout.global_batch_size, args.seq_len, config.vocab_size)
    train.train_step(model, layout, dp_rank, ids, tgt, tp_loss=layout.tp > 1)
    seen["p2p"] = ",".join(sorted({dtype for _shape, dtype in model.schedule._shapes.values()}))
    seen["master"] = ",".join(sorted({str(p.dtype) for p in model.parameters()}))
    seen["grads"] = ",".join(sorted({str(p.grad.dtype) for p in model.parameters()}))
    return seen


def test_bf16_pp_fsdp_matches_one_process_casts(pool4: RankPool, tmp_path: Path) -> None:
    """pp=2 x dp_shard=2 under ``--mixed-precision bf16``: each stage's ``fully_shard`` applies the
    policy, the stages exchange bf16 activations (and their gradients), and the last stage's logits
    are cast to float32 for the loss; the losses equal the one-process casts within one bf16 ulp."""
    import torch

    argv = ["--pp", "2", "--dp-shard", "2", "--tp", "1", "--nproc", "4", "--mixed-precision", "bf16",
            "--global-batch-size", "8", "--out-dir", str(tmp_path), *SHORT]
    res = pool4.run(_train_pp, argv, timeout=300)
    got = res[0]["losses"]
    assert all(r["losses"] == got for r in res)
    assert res[0]["layout"]["pp"] == 2 and res[0]["layout"]["param_dtype"] == "bfloat16"
    for r in res:  # every rank: bf16 compute and exchange, float32 master weights and gradients
        assert {k: r[k] for k in ("master", "grads", "mlp_weight", "mlp_input", "p2p")} == {
            "master": "torch.float32", "grads": "torch.float32", "mlp_weight": "torch.bfloat16",
            "mlp_input": "torch.bfloat16", "p2p": "bfloat16"}, r
    last = [r for r in res if "stage_logits" in r]
    assert len(last) == 2 and all(r["stage_logits"] == "torch.bfloat16" and r["loss"] == "torch.float32"
                                  for r in last), res
    want = _reference(STEPS, 8, SEQ, LR)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"\nbf16 pp=2 x dp_shard=2, {STEPS} steps: {[round(x, 4) for x in got]}\n"
          f"  1-process bf16 casts: {[round(x, 4) for x in want]}\n  max rel diff {worst:.2e}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0.0)
    assert sum(got[-3:]) / 3 < sum(got[:3]) / 3 - 0.5, got


def _comm_bytes(rank: int, world: int, argv: list[str]) -> dict[str, int]:
    """Bytes of the collectives of one training step (forward + backward) on this rank."""
    from hp_dtensor.comm_debug import CommDebugMode
    from hp_models import synthetic

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    model, dp_rank = train.build_model(args, layout, config, distributed=True)
    ids, tgt = synthetic.batch(args.seed, 0, layout.global_batch_size, args.seq_len, config.vocab_size)
    with CommDebugMode() as comm:
        train.train_step(model, layout, dp_rank, ids, tgt, tp_loss=False)
    return comm.get_comm_bytes()


def test_bf16_halves_fsdp_gather_bytes(pool4: RankPool, tmp_path: Path) -> None:
    argv = ["--tp", "1", "--dp-shard", "4", "--nproc", "4", "--out-dir", str(tmp_path), *SHORT]
    fp32 = pool4.run(_comm_bytes, argv, timeout=300)
    bf16 = pool4.run(_comm_bytes, [*argv, "--mixed-precision", "bf16"], timeout=300)
    job = tmp_path / "bf16_reduce.yaml"
    job.write_text("training:\n  param_dtype: bfloat16\n  reduce_dtype: bfloat16\n")
    both = pool4.run(_comm_bytes, ["--job", str(job), *argv], timeout=300)
    for r in range(4):
        assert bf16[r]["all_gather"] * 2 == fp32[r]["all_gather"], (fp32[r], bf16[r])
        assert bf16[r]["reduce_scatter"] == fp32[r]["reduce_scatter"], (fp32[r], bf16[r])
        assert both[r]["all_gather"] == bf16[r]["all_gather"], (bf16[r], both[r])
        assert both[r]["reduce_scatter"] * 2 == fp32[r]["reduce_scatter"], (fp32[r], both[r])
    print(f"\ndp_shard=4, one step, rank 0: all_gather {fp32[0]['all_gather']:,} B fp32 -> "
          f"{bf16[0]['all_gather']:,} B bf16; reduce_scatter {fp32[0]['reduce_scatter']:,} B fp32 reduce -> "
          f"{both[0]['reduce_scatter']:,} B bf16 reduce")


@pytest.mark.parametrize("argv,words", [
    (["--mixed-precision", "bf16"], ["param_dtype bfloat16", "no data-parallel sharding", "tp=2", "--dp-shard 2"]),
    (["--mixed-precision", "bf16", "--config", "tiny-moe", "--tp", "4", "--ep", "2", "--nproc", "4"],
     ["param_dtype bfloat16", "no data-parallel sharding", "ep=2"]),
], ids=["no-dp-sharding", "moe-no-dp-sharding"])
def test_bad_settings_fail_before_any_rank_starts(argv, words, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        train.main([*argv, "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


def test_bad_dtype_in_job_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("training:\n  param_dtype: float16\n")
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job), "--out-dir", str(tmp_path / "out")])
    assert "training.param_dtype must be float32 (fp32) or bfloat16 (bf16), got 'float16'" in str(info.value.code)
