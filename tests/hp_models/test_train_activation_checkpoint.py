# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""Activation checkpointing in the trainer: the gradients of a training step are bit-equal with and
without it (none, full, selective every 2nd and every 3rd block), on one process and through the
trainer's own build at tp=2 x dp_shard=2 on 4 gloo ranks (checkpointing applied after TP and before
fully_shard, so the recomputation re-runs the TP collectives and needs FSDP to gather again); the
activation bytes a forward keeps for backward are counted (saved-tensor hooks) and fall
full < selective < none; under pipeline parallelism (pp=2 x tp=2) the losses are bit-equal too;
under context parallelism (cp=2 x dp_shard=2, on causal data and on packed documents, whose
document ends each recomputed layer must see again) and expert parallelism (the tiny MoE model at
ep=2 x tp=2 x dp_shard=2, the token all-to-alls rerun in the recomputation) the gradients and the
loss are bit-equal with and without it; the job section and flags fail closed before any rank
starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

SHORT = ["--steps", "3", "--seq-len", "16", "--lr", "1e-2", "--checkpoint-every", "100"]
# (flags, the block indices checkpointed in the tiny model's 4 layers)
MODES = [
    ([], []),
    (["--activation-checkpoint", "full"], [0, 1, 2, 3]),
    (["--activation-checkpoint", "selective"], [1, 3]),  # every 2nd (the default option), as torchtitan counts
    (["--activation-checkpoint", "selective", "--ac-every", "3"], [2]),
]


def _grads(model: Any) -> dict[str, Any]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _one_step(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """Build through the trainer, run one ``train_step``; rank 0 returns the whole gradients, the
    loss and which layers are checkpointed."""
    from hp_dtensor.comm_debug import CommDebugMode
    from hp_models.activation_checkpoint import is_checkpointed
    from hp_models.qwen3_5.model import decoder_layers
    from hp_models.trainer.data import step_batch

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    model, dp_rank = train.build_model(args, layout, config, distributed=world > 1)
    ids, tgt = step_batch(args.seed, 0, layout, args.seq_len, config.vocab_size)
    with CommDebugMode() as comm:
        loss = train.train_step(model, layout, dp_rank, ids, tgt, tp_loss=world > 1 and layout.tp > 1)
    checkpointed = [i for i, b in enumerate(decoder_layers(model.model)) if is_checkpointed(b)]
    grads = _grads(model)
    return {"grads": grads, "loss": loss, "checkpointed": checkpointed, "layout": layout.as_dict(),
            "comm": comm.get_comm_counts()} if rank == 0 else None


def _assert_bit_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    import torch

    assert set(got) == set(want)
    unequal = [n for n in want if not torch.equal(got[n], want[n])]
    assert not unequal, f"gradients differ with activation checkpointing: {unequal}"


def test_one_process_gradients_bit_equal(tmp_path: Path) -> None:
    argv = ["--tp", "1", "--nproc", "1", "--out-dir", str(tmp_path), *SHORT]
    runs = [(flags, want, _one_step(0, 1, [*argv, *flags])) for flags, want in MODES]
    base = runs[0][2]
    for flags, want, run in runs:
        assert run["checkpointed"] == want, flags
        assert run["loss"] == base["loss"], flags
        _assert_bit_equal(run["grads"], base["grads"])
    print(f"\n1 process: {len(runs)} modes, {len(base['grads'])} gradients each, bit-equal")


def test_tp2_dp2_gradients_bit_equal(pool4: RankPool, tmp_path: Path) -> None:
    argv = ["--tp", "2", "--dp-shard", "2", "--nproc", "4", "--out-dir", str(tmp_path), *SHORT]
    base = None
    gathers = []
    for flags, want in MODES:
        run = pool4.run(_one_step, [*argv, *flags], timeout=300)[0]
        assert run["checkpointed"] == want, flags
        gathers.append(run["comm"].get("all_gather", 0))
        if base is None:
            base = run
            continue
        assert run["loss"] == base["loss"], flags
        _assert_bit_equal(run["grads"], base["grads"])
    # the recomputation runs the checkpointed blocks' TP collectives again (sequence-parallel
    # all-gathers at each token mixer and MLP): more of them the more blocks are checkpointed
    assert gathers[0] < gathers[3] < gathers[2] < gathers[1], gathers
    print(f"\ntp=2 x dp_shard=2: {len(MODES)} modes, {len(base['grads'])} gradients each, bit-equal; "
          f"all_gathers per step (none, full, every 2nd, every 3rd): {gathers}")


def test_tp2_dp2_losses_equal_over_steps(pool4: RankPool, tmp_path: Path) -> None:
    """Three optimizer steps through ``train.train`` (checkpoints, AdamW): the same losses."""

    def argv(out: str, *flags: str) -> list[str]:
        return ["--tp", "2", "--dp-shard", "2", "--nproc", "4", "--out-dir", str(tmp_path / out), *SHORT, *flags]

    plain = pool4.run(_train, argv("plain"), timeout=300)[0]
    full = pool4.run(_train, argv("full", "--activation-checkpoint", "full"), timeout=300)[0]
    assert full["losses"] == plain["losses"] and len(plain["losses"]) == 3
    assert full["layout"]["activation_checkpoint"] == "full" and "activation_checkpoint" not in plain["layout"]


def test_pp2_tp2_losses_equal(pool4: RankPool, tmp_path: Path) -> None:
    """Pipeline parallelism (pp=2 x tp=2, 2 layers a stage, 1F1B over 2 microbatches): checkpointing
    the model's layers 2 and 4 (selective every 2nd; one per stage) leaves the losses bit-equal."""

    def argv(out: str, *flags: str) -> list[str]:
        return ["--pp", "2", "--tp", "2", "--nproc", "4", "--out-dir", str(tmp_path / out), *SHORT, "--steps", "2",
                *flags]

    plain = pool4.run(_train, argv("plain"), timeout=300)[0]
    every2 = pool4.run(_train, argv("every2", "--activation-checkpoint", "selective"), timeout=300)[0]
    assert every2["losses"] == plain["losses"] and len(plain["losses"]) == 2
    assert every2["layout"]["activation_checkpoint"] == "selective every 2" and every2["layout"]["pp"] == 2


CP_CAUSAL = """
model: {use_attn_mask_compression: true}
parallelism: {data_parallel_shard: 2, context_parallel: 2, tensor_parallel: 1}
training: {global_batch_size: 8, local_batch_size: 2}
"""
CP_PACKED = """
train_dataset: {dataloader: {config: {create_compressed_eod_mask: true, create_attention_mask: false}}}
parallelism: {data_parallel_shard: 2, context_parallel: 2, tensor_parallel: 1}
training: {global_batch_size: 8, local_batch_size: 2}
"""
EP2 = """
parallelism: {tensor_parallel: 2, expert_parallel: 2, disable_gradient_division: false}
training: {global_batch_size: 8, local_batch_size: 2}
"""


@pytest.mark.parametrize("job,flags,layout", [
    (CP_CAUSAL, [], {"cp": 2, "dp_shard": 2, "accumulation_steps": 2}),
    (CP_PACKED, [], {"cp": 2, "dp_shard": 2, "accumulation_steps": 2}),
    (EP2, ["--config", "tiny-moe"], {"ep": 2, "tp": 2, "dp_shard": 2, "efsdp": 2, "accumulation_steps": 2}),
], ids=["cp2-dp2-causal", "cp2-dp2-packed-eod", "ep2-tp2-dp2-moe"])
def test_cp_and_ep_gradients_bit_equal(pool4: RankPool, job: str, flags: list[str], layout: dict[str, Any],
                                       tmp_path: Path) -> None:
    """One training step (two micro-steps) with every decoder layer checkpointed: the loss and
    every whole gradient bit-equal to the run without checkpointing."""
    path = tmp_path / "job.yaml"
    path.write_text(job)
    argv = ["--job", str(path), "--nproc", "4", "--out-dir", str(tmp_path), *flags, *SHORT, "--seq-len", "32"]
    base = pool4.run(_one_step, argv, timeout=300)[0]
    full = pool4.run(_one_step, [*argv, "--activation-checkpoint", "full"], timeout=300)[0]
    assert base["checkpointed"] == [] and full["checkpointed"] == [0, 1, 2, 3]
    assert all(full["layout"][k] == v for k, v in layout.items()), full["layout"]
    assert full["loss"] == base["loss"]
    _assert_bit_equal(full["grads"], base["grads"])
    nonzero = sum(int(g.count_nonzero()) for g in base["grads"].values())
    assert nonzero > 0.5 * sum(g.numel() for g in base["grads"].values())
    print(f"\n{'/'.join(f'{k}={v}' for k, v in layout.items())}: loss {base['loss']:.6f} bit-equal, "
          f"{len(base['grads'])} gradients bit-equal under full checkpointing")


def _train(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"losses": out["losses"], "layout": layout.as_dict()}


def test_saved_activation_bytes_fall() -> None:
    """Bytes kept for backward by one forward of the tiny model (batch 2 x 64 tokens), counted:
    full < selective every 2nd < selective every 3rd < none."""
    import torch
    import torch.nn.functional as F

    from hp_models.activation_checkpoint import SavedActivations, apply_activation_checkpoint
    from hp_models.qwen3_5 import tiny_config
    from hp_models.qwen3_5.model import decoder_layers
    from hp_protocols import ActivationCheckpointConfig

    def saved(mode: str, option: str = "2") -> int:
        torch.manual_seed(0)
        model = tiny_config().build()
        apply_activation_checkpoint(decoder_layers(model.model),
                                    ActivationCheckpointConfig(mode=mode, selective_ac_option=option))
        ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
        with SavedActivations(model) as count:
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        return count.bytes

    none, every3, every2, full = saved("none"), saved("selective", "3"), saved("selective", "2"), saved("full")
    print(f"\nsaved activations: none {none:,} B; selective/3 {every3 / none:.3f}; selective/2 {every2 / none:.3f}; "
          f"full {full / none:.3f} of none")
    assert full < every2 < every3 < none
    # 4 layers: checkpointing every layer keeps only its input (and what the embedding and head save)
    assert full < 0.15 * none


# ---------------------------------------------------------------- before any rank starts
TP2 = {"parallelism": {"tensor_parallel": 2}}


@pytest.mark.parametrize("job,section,flags,words", [
    (TP2, {"mode": "sometimes"}, [], ["activation_checkpoint.mode", "'sometimes'", "'selective'"]),
    (TP2, {"mode": "selective", "selective_ac_option": "op"}, [], ["selective_ac_option", "'op'", "positive integer"]),
    (TP2, {"mode": "selective", "selective_ac_option": 0}, [], ["selective_ac_option", "positive integer", "0"]),
    (TP2, {"mode": "full", "every": 2}, [], ["unknown key(s) 'every' in activation_checkpoint"]),
    (TP2, {"mode": "full"}, ["--ac-every", "2"], ["--ac-every 2", "'full'", "--activation-checkpoint selective"]),
], ids=["mode", "op", "zero", "unknown-key", "every-without-selective"])
def test_bad_settings_fail_before_any_rank_starts(job, section, flags, words, tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**job, "activation_checkpoint": section}))
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(path), "--nproc", "4", *flags, "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


def test_bad_flag_values_are_refused(capsys) -> None:
    for argv in (["--activation-checkpoint", "some"], ["--ac-every", "0"], ["--ac-every", "x"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert "--a" in capsys.readouterr().err
