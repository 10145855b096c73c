"""The job file's ``activation_checkpoint:`` section and ``training`` dtypes: read into enums,
torchtitan's block selection (every k-th block counted from 1), and a ``ValueError`` naming every
wrong value when the job is read."""

from __future__ import annotations

import pytest

from hp_protocols import ActivationCheckpointMode, FloatDType, JobConfig


def test_defaults_are_plain_training() -> None:
    job = JobConfig.from_dict({})
    assert job.activation_checkpoint.mode is ActivationCheckpointMode.NONE
    assert job.training.param_dtype is FloatDType.FLOAT32 and job.training.reduce_dtype is FloatDType.FLOAT32
    assert not any(job.activation_checkpoint.checkpointed(i) for i in range(8))


@pytest.mark.parametrize("section,layers,want", [
    ({"mode": "full"}, 4, [0, 1, 2, 3]),
    ({"mode": "selective"}, 6, [1, 3, 5]),  # default option "2"
    ({"mode": "selective", "selective_ac_option": "3"}, 7, [2, 5]),
    ({"mode": "selective", "selective_ac_option": 1}, 3, [0, 1, 2]),  # YAML int
    ({"mode": "SELECTIVE", "selective_ac_option": " 4 "}, 4, [3]),
    ({"mode": "none", "selective_ac_option": "2"}, 4, []),
])
def test_block_selection(section: dict[str, object], layers: int, want: list[int]) -> None:
    ac = JobConfig.from_dict({"activation_checkpoint": section}).activation_checkpoint
    assert [i for i in range(layers) if ac.checkpointed(i)] == want
    assert ac.selective_ac_option == str(ac.every)


@pytest.mark.parametrize("param,reduce,want", [
    ("bfloat16", "float32", (FloatDType.BFLOAT16, FloatDType.FLOAT32)),
    ("bf16", "bf16", (FloatDType.BFLOAT16, FloatDType.BFLOAT16)),
    ("fp32", "bfloat16", (FloatDType.FLOAT32, FloatDType.BFLOAT16)),
])
def test_dtypes(param: str, reduce: str, want: tuple[FloatDType, FloatDType]) -> None:
    t = JobConfig.from_dict({"training": {"param_dtype": param, "reduce_dtype": reduce}}).training
    assert (t.param_dtype, t.reduce_dtype) == want
    assert [d.itemsize for d in want] == [2 if d is FloatDType.BFLOAT16 else 4 for d in want]


@pytest.mark.parametrize("raw,words", [
    ({"activation_checkpoint": {"mode": "partial"}}, ["activation_checkpoint.mode", "'partial'", "'full'"]),
    ({"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}},
     ["selective_ac_option", "'op'", "op-level"]),
    ({"activation_checkpoint": {"selective_ac_option": -1}}, ["selective_ac_option", "-1"]),
    ({"activation_checkpoint": {"selective_ac_option": True}}, ["selective_ac_option", "True"]),
    ({"activation_checkpoint": {"mode": "full", "layers": 2}}, ["unknown key(s) 'layers' in activation_checkpoint"]),
    ({"activation_checkpoint": {"modee": "full"}}, ["'modee' (did you mean 'mode'?)", "activation_checkpoint"]),
    ({"training": {"param_dtype": "float16"}}, ["training.param_dtype", "'float16'", "bfloat16"]),
    ({"training": {"reduce_dtype": 32}}, ["training.reduce_dtype", "32"]),
])
def test_wrong_values_name_themselves(raw: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        JobConfig.from_dict(raw)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_mindformers_recompute_section_is_ignored_not_read() -> None:
    """MindFormers' own recompute settings are another section: named as ignored, never taken as
    this trainer's activation checkpointing (whose section is read whole)."""
    config = JobConfig.from_dict({"recompute_config": {"recompute": True}, "activation_checkpoint": {"mode": "full"}})
    assert "recompute_config" in config.ignored
    assert config.activation_checkpoint.mode.value == "full"
