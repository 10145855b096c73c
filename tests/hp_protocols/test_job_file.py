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
        "checkpoint", "context", "lr_scheduler", "model.hidden_size", "model.model_type", "optimizer",
        "train_dataset.dataloader.config.eod", "train_dataset.dataloader.config.reset_attention_mask",
        "train_dataset.dataloader.config.seq_length", "train_dataset.dataloader.sizes",
        "train_dataset.dataloader.type", "train_dataset.num_parallel_workers", "training.max_norm",
        "training.seed", "training.steps",
    )
    d = job.resolve(8)  # the EOD compression satisfies the CP rule
    assert (d.dp_shard, d.cp, d.tp, d.num_accumulation_steps) == (2, 2, 2, 4)


def test_static_graph_file_reads_model_config() -> None:
    job = JobConfig.from_yaml(textwrap.dedent(STATIC))
    assert (job.model.num_hidden_layers, job.model.num_attention_heads, job.model.use_attn_mask_compression) == (
        4, 8, True)
    assert job.ignored == ("callbacks", "lr_schedule", "model.arch", "model.model_config.type",
                           "model.model_config.use_eod_attn_mask_compression", "run_mode", "runner_config")
    assert job.resolve(8).dp_replicate == 2
    assert describe_ignored(job.ignored) == (
        "not read by this trainer, ignored: section(s) callbacks, lr_schedule, run_mode, runner_config; "
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
        "parallelism": {"data_parallel_shard": 2, "context_parallel": 2}, "training": {},
        "model": {"num_hidden_layers": 4, "num_attention_heads": 8, "use_attn_mask_compression": True},
    }
