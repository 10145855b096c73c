# mypy: disable-error-code="no-untyped-def"
"""The learning-rate schedule: each step's rate equals the closed form (warmup, then cosine or
linear decay to lr_min) for seeded generated schedules; the trainer uses those rates (its losses
equal plain torch stepping with them); a resumed run continues the schedule, and a resume under
another schedule is refused; bad schedule fields fail before any rank starts."""

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
    ({"lr_decay": "linear", "lr_min": 0.5}, ["lr_min 0.5 is above the peak learning rate --lr 0.01"]),
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
