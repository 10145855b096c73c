# mypy: disable-error-code="no-untyped-def"
"""The learning-rate schedule: each step's rate equals the closed form (warmup, then cosine or
linear decay to lr_min) for seeded generated schedules; the trainer uses those rates (its losses
equal plain torch stepping with them); a resumed run continues the schedule, and a resume under
another schedule is refused; bad schedule fields fail before any rank starts.  A MindFormers job
file's ``lr_schedule:`` / ``optimizer:`` give the per-step rates of the equivalent flags (as the
trainer logs them) and the AdamW betas they name (losses equal plain torch with them); explicit
flags win over the file; bad values there fail before any rank starts; the progress line shows
each step's rate."""

from __future__ import annotations

import json
import math
import random

import pytest
from train_reference import plain_torch_run

from hp_models import train
from hp_models.job import OptimSettings
from hp_models.trainer.lr_schedule import LRSchedule
from hp_protocols import LRDecay

SHORT = ["--tp", "1", "--seq-len", "16", "--batch-size", "4", "--lr", "1e-2", "--checkpoint-every", "100"]
SCHEDULE = ["--lr-warmup-steps", "2", "--lr-decay", "cosine", "--lr-min", "1e-3"]
CASES = 200


def closed_form(step: int, lr: float, warmup: int, decay: str, decay_steps: int, lr_min: float) -> float:
    """The reference, written from the definition: linear warmup to ``lr`` over ``warmup`` steps
    (step index ``step`` is the ``step + 1``-th step), then ``decay`` to ``lr_min`` over
    ``decay_steps`` steps, flat at ``lr_min`` after."""
    done = step + 1
    if warmup and done <= warmup:
        return lr * done / warmup
    if decay == "none":
        return lr
    into = done - warmup
    if into >= decay_steps:
        return lr_min
    frac = into / decay_steps
    if decay == "linear":
        return lr - (lr - lr_min) * frac
    return lr_min + (lr - lr_min) * (math.cos(math.pi * frac) + 1) / 2


def test_every_step_equals_the_closed_form() -> None:
    rng = random.Random(30)
    checked = 0
    for _ in range(CASES):
        lr, warmup = rng.uniform(1e-4, 1.0), rng.randrange(0, 20)
        decay = rng.choice(["none", "cosine", "linear"])
        steps = warmup + rng.randrange(1, 60)
        decay_steps = rng.choice([None, rng.randrange(1, 80)])
        lr_min = rng.uniform(0, lr)
        optim = OptimSettings(warmup_steps=warmup, decay=LRDecay.parse(decay), decay_steps=decay_steps, lr_min=lr_min)
        schedule = LRSchedule.of(lr, optim, steps)
        span = decay_steps if decay_steps is not None else steps - warmup
        for step in range(steps + 5):  # (past the end: flat)
            want = closed_form(step, lr, warmup, decay, span, lr_min)
            assert schedule.at(step) == pytest.approx(want, rel=1e-12, abs=1e-15), (optim, steps, step)
            checked += 1
    assert checked > 5000
    # the default: constant, the rate of before
    assert all(LRSchedule.of(3e-3, OptimSettings(), 120).at(s) == 3e-3 for s in range(200))


def test_the_trainer_steps_with_the_schedule_and_resume_continues_it(tmp_path) -> None:
    steps = 6
    full = tmp_path / "full"
    assert train.main([*SHORT, *SCHEDULE, "--steps", str(steps), "--out-dir", str(full)]) == 0
    log = json.loads((full / "log.json").read_text())
    want = [closed_form(s, 1e-2, 2, "cosine", steps - 2, 1e-3) for s in range(steps)]
    assert log["learning_rates"] == pytest.approx(want, rel=1e-12)
    assert log["lr_schedule"] == {"warmup_steps": 2, "decay": "cosine", "decay_steps": 4, "lr_min": 1e-3}
    ref = plain_torch_run(steps, 4, 16, lambda s: want[s], None)
    assert log["losses"] == pytest.approx(ref["losses"], rel=1.5e-4, abs=1e-5)
    assert log["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1.5e-4)
    # stopped after 3 steps (the decay's length given, so it does not follow --steps), resumed to 6
    part = tmp_path / "part"
    fixed = [*SHORT, *SCHEDULE, "--lr-decay-steps", "4", "--out-dir", str(part)]
    assert train.main([*fixed, "--steps", "3", "--checkpoint-every", "3"]) == 0
    assert train.main([*fixed, "--steps", str(steps), "--resume"]) == 0
    resumed = json.loads((part / "log.json").read_text())
    assert resumed["resumed_from_step"] == 3
    assert resumed["learning_rates"] == pytest.approx(want[3:], rel=1e-12)
    assert resumed["losses"] == log["losses"]
    # another schedule would not continue this run: refused, naming it
    with pytest.raises(SystemExit) as info:
        train.main([*SHORT, *SCHEDULE, "--lr-decay-steps", "5", "--out-dir", str(part), "--steps", "8", "--resume"])
    assert "lr_schedule.decay_steps 4 (this run: 5)" in str(info.value.code), info.value.code


@pytest.mark.parametrize("training,words", [
    ({"lr_warmup_steps": -1}, ["lr_warmup_steps must be an int >= 0", "-1"]),
    ({"lr_decay": "exponential"}, ["lr_decay must be one of ['none', 'cosine', 'linear']", "'exponential'"]),
    ({"lr_decay_steps": 0}, ["lr_decay_steps must be a positive int", "0"]),
    ({"lr_min": -0.1}, ["lr_min must be a number >= 0", "-0.1"]),
    ({"max_grad_norm": 0}, ["max_grad_norm must be a number > 0", "0"]),
    ({"max_grad_norm": "big"}, ["max_grad_norm must be a number > 0", "'big'"]),
    ({"lr_decay": "linear", "lr_min": 0.5}, ["lr_min 0.5 is above the peak learning rate 0.01 (--lr"]),
    ({"lr_decay": "cosine", "lr_warmup_steps": 6}, ["leaves no step of --steps 6", "--lr-decay-steps"]),
])
def test_bad_schedule_fails_before_any_rank_starts(training, words, tmp_path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"parallelism": {"tensor_parallel": 1}, "training": training}))
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job), *SHORT, "--steps", "6", "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith("error: ") and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,words", [
    (["--lr-decay", "step"], ["--lr-decay", "invalid choice: 'step'"]),
    (["--lr-warmup-steps", "-2"], ["--lr-warmup-steps must be >= 0, got -2"]),
    (["--max-grad-norm", "0"], ["--max-grad-norm must be > 0, got 0.0"]),
    (["--lr-decay-steps", "0"], ["--lr-decay-steps must be >= 1, got 0"]),
])
def test_bad_schedule_flags_are_argparse_errors(argv, words, capsys) -> None:
    with pytest.raises(SystemExit):
        train.main(argv)
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_job_fields_and_flags_that_override_them(tmp_path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"parallelism": {"tensor_parallel": 1}, "training": {
        "lr_warmup_steps": 3, "lr_decay": "linear", "lr_min": 1e-4, "max_grad_norm": 2.0}}))
    args = train.parse_args(["--job", str(job), "--steps", "10", "--out-dir", str(tmp_path / "a")])
    _, layout = train.check_args(args)
    assert layout.optim == OptimSettings(warmup_steps=3, decay=LRDecay.LINEAR, lr_min=1e-4, max_grad_norm=2.0)
    args = train.parse_args(["--job", str(job), "--steps", "10", "--lr-decay", "cosine", "--max-grad-norm", "0.5",
                             "--lr-decay-steps", "4", "--out-dir", str(tmp_path / "b")])
    _, layout = train.check_args(args)
    assert layout.optim == OptimSettings(warmup_steps=3, decay=LRDecay.COSINE, decay_steps=4, lr_min=1e-4,
                                         max_grad_norm=0.5)
    assert train.run_settings(args, train.load_config(args), layout)["lr_schedule"] == {
        "warmup_steps": 3, "decay": "cosine", "decay_steps": 4, "lr_min": 1e-4}
    # without them: the layout and run settings of before (a checkpoint saved earlier still resumes)
    args = train.parse_args(["--tp", "1", "--out-dir", str(tmp_path / "c")])
    config, layout = train.check_args(args)
    assert layout.optim == OptimSettings()
    assert not {"lr_schedule", "max_grad_norm"} & set(train.run_settings(args, config, layout))


# ---------------------------------------------------------------- MindFormers' lr_schedule: / optimizer:
MF_STEPS = 8
MF_SHORT = ["--tp", "1", "--seq-len", "16", "--batch-size", "4", "--checkpoint-every", "100", "--steps", str(MF_STEPS)]
# the brief's cosine section, scaled: 2 of the 8 steps warm up (int(0.25 * 8)), then a half cosine to lr_end
MF_COSINE = """
optimizer: {type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, weight_decay: 0.0}
lr_schedule: {type: CosineWithWarmUpLR, learning_rate: 2.e-2, lr_end: 1.e-3, warmup_ratio: 0.25, warmup_steps: 0,
              total_steps: -1}
"""
COSINE_FLAGS = ["--lr", "2e-2", "--lr-warmup-steps", "2", "--lr-decay", "cosine", "--lr-min", "1e-3"]
# total_steps given: the decay ends at step 5 (4 steps after a 1-step warmup), flat after
MF_LINEAR = "lr_scheduler: {type: LinearWithWarmUpLR, learning_rate: 1.e-2, warmup_steps: 1, total_steps: 5}\n"
LINEAR_FLAGS = ["--lr", "1e-2", "--lr-warmup-steps", "1", "--lr-decay", "linear", "--lr-decay-steps", "4"]
MF_CONSTANT = "lr_schedule: {type: ConstantWarmUpLR, learning_rate: 4.e-3, warmup_steps: 3, total_steps: -1}\n"
CONSTANT_FLAGS = ["--lr", "4e-3", "--lr-warmup-steps", "3"]


def _logged(argv: list[str], out) -> dict:
    assert train.main([*MF_SHORT, *argv, "--out-dir", str(out)]) == 0
    return json.loads((out / "log.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("section,flags,want", [
    (MF_COSINE, COSINE_FLAGS, lambda s: closed_form(s, 2e-2, 2, "cosine", MF_STEPS - 2, 1e-3)),
    (MF_LINEAR, LINEAR_FLAGS, lambda s: closed_form(s, 1e-2, 1, "linear", 4, 0.0)),
    (MF_CONSTANT, CONSTANT_FLAGS, lambda s: closed_form(s, 4e-3, 3, "none", 1, 0.0)),
], ids=["cosine-warmup-ratio", "linear-total-steps", "constant-warmup"])
def test_job_schedule_gives_the_flags_rates(section, flags, want, tmp_path) -> None:
    job = tmp_path / "mf.yaml"
    job.write_text(section)
    from_file = _logged(["--job", str(job)], tmp_path / "file")
    from_flags = _logged(flags, tmp_path / "flags")
    assert from_file["learning_rates"] == from_flags["learning_rates"]  # the same floats, step by step
    assert from_file["learning_rates"] == pytest.approx([want(s) for s in range(MF_STEPS)], rel=1e-12)
    assert from_file["lr_schedule"] == from_flags["lr_schedule"] and from_file["lr"] == from_flags["lr"]
    print(f"\n{from_file['lr_schedule']}: {MF_STEPS} logged rates equal to the flags' "
          f"{[f'{x:.3g}' for x in from_file['learning_rates']]}")


def test_job_optimizer_betas_reach_adamw(tmp_path) -> None:
    """The cosine file's AdamW (betas 0.9, 0.95): the losses equal plain torch with those betas,
    and not those of torch's default betas."""
    job = tmp_path / "mf.yaml"
    job.write_text(MF_COSINE)
    log = _logged(["--job", str(job)], tmp_path / "run")
    assert log["adamw"] == {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    rates = log["learning_rates"]
    want = plain_torch_run(MF_STEPS, 4, 16, lambda s: rates[s], None, betas=(0.9, 0.95))["losses"]
    other = plain_torch_run(MF_STEPS, 4, 16, lambda s: rates[s], None)["losses"]
    assert log["losses"] == pytest.approx(want, rel=1.5e-4, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(log["losses"], other)) > 1e-3  # the betas matter here
    worst = max(abs(a - b) / abs(b) for a, b in zip(log["losses"], want))
    print(f"\nbetas (0.9, 0.95) from optimizer:: {MF_STEPS} losses, max rel diff vs plain torch {worst:.2e}")


def test_flags_win_over_the_job_schedule(tmp_path) -> None:
    job = tmp_path / "mf.yaml"
    job.write_text(MF_COSINE)
    args = train.parse_args([*MF_SHORT, "--job", str(job), "--lr", "5e-3", "--lr-warmup-steps", "3",
                             "--out-dir", str(tmp_path / "a")])
    _, layout = train.check_args(args)
    o = layout.optim
    assert (o.lr, o.warmup_steps, o.warmup_ratio, o.decay, o.lr_min, o.betas) == (
        5e-3, 3, None, LRDecay.COSINE, 1e-3, (0.9, 0.95))
    args = train.parse_args([*MF_SHORT, "--job", str(job), "--out-dir", str(tmp_path / "b")])
    _, layout = train.check_args(args)
    assert (layout.optim.lr, layout.optim.warmup_ratio) == (2e-2, 0.25)


@pytest.mark.parametrize("section,words", [
    ("lr_schedule: {type: CosineWithWarmUpLR, learning_rate: -1.e-5}",
     ["lr_schedule.learning_rate must be a number > 0, got -1e-05"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, learning_rate: 1.e-5, warmup_ratio: 1.2}",
     ["lr_schedule.warmup_ratio must be a number in [0, 1]", "1.2"]),
    ("lr_schedule: {type: WarmUpStableDecayLR, learning_rate: 1.e-5}",
     ["lr_schedule.type 'WarmUpStableDecayLR' is not supported", "'CosineWithWarmUpLR'", "'ConstantWarmUpLR'"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, learning_rate: 1.e-5, warmup_ration: 0.1}",
     ["'warmup_ration' (did you mean 'warmup_ratio'?) in lr_schedule"]),
    ("optimizer: {type: AdamW, weight_decays: 0.1}", ["'weight_decays' (did you mean 'weight_decay'?) in optimizer"]),
], ids=["negative-lr", "warmup-ratio-above-1", "unknown-type", "typo-key", "optimizer-typo"])
def test_bad_job_schedule_fails_before_any_rank_starts(section, words, tmp_path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"parallelism: {{tensor_parallel: 2}}\n{section}\n")
    with pytest.raises(SystemExit) as info:
        train.main(["--job", str(job), "--nproc", "4", "--out-dir", str(tmp_path / "out")])
    msg = str(info.value.code)
    assert msg.startswith(f"error: job file {job}: ") and all(w in msg for w in words), msg
    assert msg.count("\n") == 0 and not (tmp_path / "out").exists()


def test_progress_line_shows_the_rate(tmp_path, capsys) -> None:
    assert train.main([*SHORT, *SCHEDULE, "--steps", "4", "--out-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    last = [line for line in err.splitlines() if "step 4/4" in line]
    want = closed_form(3, 1e-2, 2, "cosine", 2, 1e-3)
    assert len(last) == 1 and f"  lr {want:.3e}  " in last[0], err
