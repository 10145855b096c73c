"""A whole MindFormers job file is accepted: ``parallelism`` and ``training`` are read whole, the
model and data-set facts the rules need are read from where either file style puts them, every
other section and key is named as ignored, and a misspelt key in what is read still raises."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import pytest

from hp_protocols import JobConfig, ParallelismConfig, TrainingConfig
from hp_protocols.job_file import JobFileParts, describe_ignored, split_job_file

# the dynamic-graph style: model fields flat under model:, optimizer / lr_scheduler / checkpoint
DYNAMIC = """
checkpoint: {enable_save: False, save_path: ./output}
training: {steps: 10, local_batch_size: 1, global_batch_size: 8, max_norm: 1.0, seed: 42}
parallelism: {data_parallel_shard: -1, tensor_parallel: 2, context_parallel: 2, pipeline_parallel: 1}
optimizer: {type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, weight_decay: 0.01}
lr_scheduler: {type: ConstantWarmUpLR, learning_rate: 1.e-5, warmup_ratio: 0}
train_dataset:
  dataloader:
    type: BlendedMegatronDatasetDataLoader
    sizes: [1000, 0, 0]
    config: {seq_length: 64, eod: 1, reset_attention_mask: False, create_attention_mask: False,
             create_compressed_eod_mask: True}
  num_parallel_workers: 8
model:
  model_type: qwen3_5
  num_hidden_layers: 4
  num_attention_heads: 8
  hidden_size: 64
context: {mode: 1}
"""
# the static-graph style: model facts under model.model_config (num_layers / num_heads), runner_config
STATIC = """
run_mode: train
runner_config: {epochs: 2, batch_size: 1, sink_mode: True}
lr_schedule: {type: CosineWithWarmUpLR, learning_rate: 1.e-5}
callbacks: [{type: MFLossMonitor}, {type: CheckpointMonitor}]
parallelism: {data_parallel_shard: 2, context_parallel: 2}
model:
  model_config: {type: LlamaConfig, num_layers: 4, num_heads: 8, use_attn_mask_compression: True,
                 use_eod_attn_mask_compression: False}
  arch: {type: LlamaForCausalLM}
"""


def split_raw(raw: dict[str, Any]) -> JobFileParts:
    fields = [f.name for f in dataclasses.fields(ParallelismConfig)], [f.name for f in dataclasses.fields(TrainingConfig)]
    return split_job_file(raw, *fields)


def split(text: str) -> JobFileParts:
    import yaml

    return split_raw(yaml.safe_load(textwrap.dedent(text)))


def test_dynamic_graph_file_is_read_and_the_rest_named() -> None:
    job = JobConfig.from_yaml(textwrap.dedent(DYNAMIC))
    assert (job.parallelism.tensor_parallel, job.parallelism.context_parallel) == (2, 2)
    assert (job.training.global_batch_size, job.training.local_batch_size) == (8, 1)
    assert (job.model.num_hidden_layers, job.model.num_attention_heads) == (4, 8)
    assert job.data.create_compressed_eod_mask and not job.data.create_attention_mask
    assert job.ignored == (
        "checkpoint", "context", "model.hidden_size", "model.model_type",
        "train_dataset.dataloader.config.eod", "train_dataset.dataloader.config.reset_attention_mask",
        "train_dataset.dataloader.config.seq_length", "train_dataset.dataloader.sizes",
        "train_dataset.dataloader.type", "train_dataset.num_parallel_workers", "training.max_norm",
        "training.seed", "training.steps",
    )
    # optimizer: and lr_scheduler: (the dynamic-graph name) are read as training fields
    t = job.training
    assert (t.adam_betas, t.adam_eps, t.weight_decay, t.learning_rate) == ((0.9, 0.95), 1e-8, 0.01, 1e-5)
    assert (t.lr_decay, t.lr_warmup_ratio) == ("none", 0.0)
    d = job.resolve(8)  # the EOD compression satisfies the CP rule
    assert (d.dp_shard, d.cp, d.tp, d.num_accumulation_steps) == (2, 2, 2, 4)


def test_static_graph_file_reads_model_config() -> None:
    job = JobConfig.from_yaml(textwrap.dedent(STATIC))
    assert (job.model.num_hidden_layers, job.model.num_attention_heads, job.model.use_attn_mask_compression) == (
        4, 8, True)
    assert (job.training.lr_decay, job.training.learning_rate) == ("cosine", 1e-5)
    assert job.ignored == ("callbacks", "model.arch", "model.model_config.type",
                           "model.model_config.use_eod_attn_mask_compression", "run_mode", "runner_config")
    assert job.resolve(8).dp_replicate == 2
    assert describe_ignored(job.ignored) == (
        "not read by this trainer, ignored: section(s) callbacks, run_mode, runner_config; "
        "model: arch; model.model_config: type, use_eod_attn_mask_compression")


def test_canonical_form_reads_back_unchanged() -> None:
    parts = split(DYNAMIC)
    again = split_raw(parts.canonical())
    assert again.canonical() == parts.canonical() and again.ignored == ()
    assert parts.canonical()["model"] == {"num_hidden_layers": 4, "num_attention_heads": 8}


@pytest.mark.parametrize("text,words", [
    ("parallelism: {tensor_paralel: 2}", ["'tensor_paralel' (did you mean 'tensor_parallel'?)", "in parallelism"]),
    ("parallelism: {sequence_parallel: false}", ["parallelism.sequence_parallel (False) is not a setting",
                                                 "follows tensor_parallel", "remove the key"]),
    ("training: {global_bach_size: 8}", ["'global_bach_size' (did you mean 'global_batch_size'?)", "in training"]),
    ("training: {epochs: 2}", ["'epochs'", "in training", "'steps'"]),
    ("trainig: {global_batch_size: 8}", ["unknown section 'trainig'", "did you mean 'training'"]),
    ("model: {use_attn_mask_compresion: true}", ["unknown key 'use_attn_mask_compresion' in model",
                                                 "did you mean 'use_attn_mask_compression'"]),
    ("model: {model_config: {num_hiden_layers: 4}}", ["'num_hiden_layers' in model.model_config",
                                                      "did you mean 'num_hidden_layers'"]),
    ("model: {num_hidden_layers: 4, model_config: {num_layers: 6}}",
     ["num_hidden_layers twice", "4", "model.model_config.num_layers = 6"]),
    ("model: {model_config: [1, 2]}", ["section 'model.model_config' must be a mapping, got list"]),
    ("parallelism: [1]", ["section 'parallelism' must be a mapping"]),
])
def test_misspelt_or_refused_keys_raise_naming_them(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        JobConfig.from_yaml(text)
    msg = str(info.value)
    assert all(w in msg for w in words), msg


def test_only_what_is_read_is_canonical() -> None:
    parts = split(STATIC)
    assert parts.canonical() == {
        "parallelism": {"data_parallel_shard": 2, "context_parallel": 2},
        "training": {"lr_decay": "cosine", "learning_rate": 1e-5},
        "model": {"num_hidden_layers": 4, "num_attention_heads": 8, "use_attn_mask_compression": True},
    }


# ---------------------------------------------------------------- optimizer: and lr_schedule:
@pytest.mark.parametrize("text,want", [
    # the brief's cosine example: a ratio of the run's steps (total_steps -1), known when it starts
    ("lr_schedule: {type: CosineWithWarmUpLR, learning_rate: 1.e-5, lr_end: 1.e-6, warmup_ratio: 0.01, "
     "warmup_steps: 0, total_steps: -1}",
     {"lr_decay": "cosine", "learning_rate": 1e-5, "lr_min": 1e-6, "lr_warmup_ratio": 0.01}),
    # total_steps given: the warmup is int(ratio * total) (MindFormers' rounding), the decay ends at total
    ("lr_schedule: {type: LinearWithWarmUpLR, learning_rate: 0.02, warmup_ratio: 0.25, total_steps: 10}",
     {"lr_decay": "linear", "learning_rate": 0.02, "lr_warmup_steps": 2, "lr_decay_steps": 8}),
    ("lr_scheduler: {type: ConstantWarmUpLR, learning_rate: 3.e-3, warmup_steps: 4, total_steps: 100, "
     "warmup_lr_init: 0.}",
     {"lr_decay": "none", "learning_rate": 3e-3, "lr_warmup_steps": 4}),
    ("optimizer: {type: AdamW, betas: [0.9, 0.95], eps: 1.e-6, weight_decay: 0.1, learning_rate: 5.e-4}",
     {"adam_betas": (0.9, 0.95), "adam_eps": 1e-6, "weight_decay": 0.1, "learning_rate": 5e-4}),
    ("optimizer: {type: adamw, learning_rate: 1.e-3}\nlr_schedule: {type: CosineWithWarmUpLR, learning_rate: 1.e-3}",
     {"learning_rate": 1e-3, "lr_decay": "cosine"}),
    ("lr_schedule: {type: CosineWithWarmUpLR, warmup_steps: 2}\ntraining: {lr_warmup_steps: 2}",
     {"lr_decay": "cosine", "lr_warmup_steps": 2}),
], ids=["cosine-ratio", "linear-total", "constant-scheduler", "adamw", "same-lr-twice", "same-warmup-twice"])
def test_optimizer_and_schedule_sections_map_onto_training(text: str, want: dict[str, Any]) -> None:
    assert split(text).training == want
    job = JobConfig.from_yaml(text)
    assert all(getattr(job.training, k) == v for k, v in want.items())


@pytest.mark.parametrize("text,words", [
    ("lr_schedule: {type: CosineWithWarmUpLR, learning_rate: -1.e-5}",
     ["lr_schedule.learning_rate must be a number > 0, got -1e-05"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, warmup_ratio: 1.5}",
     ["lr_schedule.warmup_ratio must be a number in [0, 1]", "1.5"]),
    ("lr_schedule: {type: PolynomialWithWarmUpLR}",
     ["lr_schedule.type 'PolynomialWithWarmUpLR' is not supported",
      "['CosineWithWarmUpLR', 'LinearWithWarmUpLR', 'ConstantWarmUpLR']"]),
    ("lr_schedule: {type: CosinWithWarmUpLR}", ["did you mean 'CosineWithWarmUpLR'?"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, warmup_step: 3}",
     ["'warmup_step' (did you mean 'warmup_steps'?)", "in lr_schedule"]),
    ("lr_scheduler: {type: CosineWithWarmUpLR, lr_ends: 0.1}", ["'lr_ends' (did you mean 'lr_end'?)", "lr_scheduler"]),
    ("lr_schedule: {learning_rate: 0.1}", ["lr_schedule.type is missing", "CosineWithWarmUpLR"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, warmup_steps: 3, warmup_ratio: 0.1}",
     ["both warmup_steps 3 and warmup_ratio 0.1"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, warmup_steps: 5, total_steps: 5}",
     ["total_steps 5 leaves no step after the warmup of 5"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, total_steps: 0}", ["total_steps must be a positive int or -1"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, num_cycles: 1.0}", ["lr_schedule.num_cycles 1.0 is not built"]),
    ("lr_schedule: {type: CosineWithWarmUpLR, warmup_lr_init: 1.e-7}", ["warmup_lr_init 1e-07 is not built"]),
    ("lr_schedule: {type: ConstantWarmUpLR, lr_end: 0.1}", ["lr_end 0.1 with type ConstantWarmUpLR"]),
    ("lr_schedule: {type: CosineWithWarmUpLR}\nlr_scheduler: {type: CosineWithWarmUpLR}",
     ["both lr_schedule: and lr_scheduler:"]),
    ("optimizer: {type: SGD}", ["optimizer.type 'SGD' is not supported", "['AdamW']"]),
    ("optimizer: {type: AdamW, beta: [0.9, 0.95]}", ["'beta' (did you mean 'betas'?)", "in optimizer"]),
    ("optimizer: {type: AdamW, betas: [0.9, 1.5]}", ["optimizer.betas must be two numbers in [0, 1)"]),
    ("optimizer: {type: AdamW, eps: 0}", ["optimizer.eps must be a number > 0"]),
    ("optimizer: {type: AdamW, weight_decay: -0.1}", ["optimizer.weight_decay must be a number >= 0"]),
    ("optimizer: {type: AdamW, learning_rate: 0.1}\nlr_schedule: {type: ConstantWarmUpLR, learning_rate: 0.2}",
     ["learning_rate twice", "0.1", "0.2"]),
    ("training: {lr_warmup_steps: 3}\nlr_schedule: {type: ConstantWarmUpLR, warmup_steps: 4}",
     ["training.lr_warmup_steps 3", "4", "keep one"]),
    ("lr_shedule: {type: ConstantWarmUpLR}", ["unknown section 'lr_shedule'", "did you mean 'lr_schedule'"]),
    ("training: {learning_rate: -3}", ["learning_rate must be a number > 0, got -3"]),
], ids=["negative-lr", "ratio-above-1", "unknown-type", "type-typo", "key-typo", "scheduler-key-typo",
        "no-type", "steps-and-ratio", "no-decay-left", "total-zero", "num-cycles", "warmup-lr-init",
        "constant-lr-end", "both-names", "sgd", "betas-typo", "beta-range", "eps", "weight-decay",
        "two-lrs", "schedule-vs-training", "section-typo", "training-lr"])
def test_bad_optimizer_or_schedule_raises_naming_it(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        JobConfig.from_yaml(text).resolve(1)
    msg = str(info.value)
    assert all(w in msg for w in words), msg
