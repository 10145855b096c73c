# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Every YAML job scenario loads, validates and derives its expected numbers; every listed
violation raises with the fields and numbers named."""

from __future__ import annotations

import textwrap

import pytest

from hp_protocols import JobConfig, ParallelismConfig


def load(text: str) -> JobConfig:
    return JobConfig.from_yaml(textwrap.dedent(text))


def test_defaults_are_the_docs() -> None:
    p = ParallelismConfig()
    assert (p.data_parallel_shard, p.reshard_after_forward_policy, p.cpu_offload, p.disable_gradient_division) == (
        -1, "default", False, True)
    assert (p.tensor_parallel, p.context_parallel, p.pipeline_parallel, p.expert_parallel) == (1, 1, 1, 1)
    assert (p.context_parallel_method, p.context_parallel_async, p.ulysses_degree_in_cp,
            p.context_parallel_mask_type) == ("colossal", False, None, "causal")
    assert (p.pipeline_parallel_interleave_num, p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_overlap_p2p,
            p.pipeline_parallel_overlap_b_f, p.pipeline_parallel_schedule) == (1, None, False, False, "1f1b")
    assert (p.moe_token_dispatcher_type, p.npu_nums_per_device) == ("alltoall", 8)


def test_1_4_A_single_node_pure_fsdp() -> None:
    d = load("""
        parallelism:
          data_parallel_shard: -1
          reshard_after_forward_policy: "default"
          cpu_offload: False
          disable_gradient_division: True
          tensor_parallel: 1
          context_parallel: 1
          pipeline_parallel: 1
          expert_parallel: 1
        training: {global_batch_size: 32, local_batch_size: 2}
    """).resolve(8)
    assert (d.dp_replicate, d.dp_shard, d.data_parallel, d.fsdp) == (1, 8, 8, 8)
    assert d.fsdp_enabled and d.reshard_after_forward and d.num_accumulation_steps == 2
    assert d.dense_mesh_shape() == (1, 1, 8, 1)


def test_1_4_B_two_node_hsdp() -> None:
    d = load("""
        parallelism:
          data_parallel_shard: 8
          tensor_parallel: 1
          context_parallel: 1
          pipeline_parallel: 1
    """).resolve(16)
    assert (d.data_parallel, d.dp_replicate, d.dp_shard) == (16, 2, 8)
    assert d.dense_mesh_shape() == (1, 2, 8, 1)


def test_2_4_dp_plus_tp() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, tensor_parallel: 2, context_parallel: 1, pipeline_parallel: 1,
                      expert_parallel: 1, reshard_after_forward_policy: "default", disable_gradient_division: True}
    """).resolve(8)
    assert (d.data_parallel, d.dp_shard, d.tp, d.sequence_parallel) == (4, 4, 2, True)
    assert d.dense_mesh_shape() == (1, 1, 4, 2)


def test_3_5_A_colossal_cp() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, tensor_parallel: 1, context_parallel: 2,
                      context_parallel_method: colossal, context_parallel_mask_type: causal, pipeline_parallel: 1}
        model: {use_attn_mask_compression: true}
    """).resolve(8)
    assert (d.data_parallel, d.dp_shard, d.fsdp, d.ulysses_degree) == (4, 4, 8, 1)


def test_3_5_B_ulysses_cp() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, context_parallel: 4, context_parallel_method: ulysses,
                      ulysses_degree_in_cp: 4, context_parallel_async: False, tensor_parallel: 1, pipeline_parallel: 1}
        model: {use_attn_mask_compression: true}
    """).resolve(8)
    assert (d.data_parallel, d.dp_shard, d.ulysses_degree, d.fsdp) == (2, 2, 4, 8)


def test_3_5_B_ulysses_degree_defaults_to_cp_and_eod_mask_is_accepted() -> None:
    d = load("""
        parallelism: {context_parallel: 4, context_parallel_method: ulysses}
        train_dataset: {dataloader: {config: {create_compressed_eod_mask: true, create_attention_mask: false}}}
    """).resolve(8)
    assert d.ulysses_degree == 4


def test_3_5_C_hybrid_cp() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, context_parallel: 4, context_parallel_method: hybrid,
                      ulysses_degree_in_cp: 2, context_parallel_mask_type: causal, tensor_parallel: 1,
                      pipeline_parallel: 1}
        model: {use_attn_mask_compression: true}
    """).resolve(8)
    assert (d.dp_shard, d.ulysses_degree, d.fsdp) == (2, 2, 8)


def test_4_4_one_auto_layers() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, tensor_parallel: 4, pipeline_parallel: 2,
                      pipeline_parallel_interleave_num: 2, pipeline_parallel_layers_per_stage: auto,
                      pipeline_parallel_overlap_p2p: True}
        model: {num_hidden_layers: 8}
        training: {global_batch_size: 8, local_batch_size: 1}
    """).resolve(8)
    assert d.virtual_stages == 4 and d.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert d.reshard_after_forward is False  # default under PP resolves to never
    assert d.num_accumulation_steps == 8 and d.pipeline_microbatches == 8


def test_4_4_two_explicit_layers() -> None:
    d = load("""
        parallelism:
          data_parallel_shard: -1
          tensor_parallel: 4
          pipeline_parallel: 2
          pipeline_parallel_interleave_num: 2
          pipeline_parallel_layers_per_stage:
            - "0-1, 4-8"
            - "2-3, 9"
          pipeline_parallel_overlap_p2p: True
        model: {num_hidden_layers: 10}
    """).resolve(8)
    assert d.stage_layers == ((0, 1), (2, 3), (4, 5, 6, 7, 8), (9,))


def test_5_4_A_ep_le_tp() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, tensor_parallel: 4, expert_parallel: 2,
                      moe_token_dispatcher_type: alltoall, context_parallel: 1, pipeline_parallel: 1}
    """).resolve(8)
    assert (d.dp_shard, d.efsdp, d.ep) == (2, 4, 2)
    assert d.sparse_mesh_shape() == (1, 1, 4, 2)


def test_5_4_B_ep_gt_tp_deredundancy() -> None:
    d = load("""
        parallelism: {data_parallel_shard: -1, tensor_parallel: 2, expert_parallel: 8,
                      moe_token_dispatcher_type: alltoall_deredundancy, npu_nums_per_device: 8,
                      context_parallel: 1, pipeline_parallel: 1}
    """).resolve(16)
    assert (d.dp_shard, d.efsdp) == (8, 2)


@pytest.mark.parametrize("yaml_text,world,exc,words", [
    ("parallelism: {tensor_parallel: 3}", 8, ValueError, ["world_size 8", "3*1*1"]),
    ("parallelism: {data_parallel_shard: 3}", 8, ValueError, ["data_parallel (8", "data_parallel_shard 3"]),
    ("parallelism: {data_parallel_shard: 0}", 8, ValueError, ["data_parallel_shard must be -1"]),
    ("parallelism: {tensor_parallel: 0}", 8, ValueError, ["tensor_parallel must be a positive int"]),
    ("training: {global_batch_size: 4, local_batch_size: 1}", 8, ValueError, ["8 * 1 = 8", "global_batch_size 4"]),
    ("parallelism: {reshard_after_forward_policy: sometimes}", 8, ValueError, ["sometimes"]),
    ("parallelism: {context_parallel: 4, context_parallel_method: ulysses, ulysses_degree_in_cp: 2}\n"
     "model: {use_attn_mask_compression: true}", 8, ValueError, ["ulysses_degree_in_cp 2", "context_parallel 4"]),
    ("parallelism: {context_parallel: 4, context_parallel_method: hybrid}\nmodel: {use_attn_mask_compression: true}",
     8, ValueError, ["hybrid needs ulysses_degree_in_cp"]),
    ("parallelism: {context_parallel: 4, context_parallel_method: hybrid, ulysses_degree_in_cp: 4}\n"
     "model: {use_attn_mask_compression: true}", 8, ValueError, ["1 < ulysses_degree_in_cp < context_parallel", "4"]),
    ("parallelism: {context_parallel: 8, context_parallel_method: hybrid, ulysses_degree_in_cp: 3}\n"
     "model: {use_attn_mask_compression: true}", 8, ValueError, ["ulysses_degree_in_cp 3"]),
    ("parallelism: {context_parallel: 4, context_parallel_method: ulysses, context_parallel_async: true}\n"
     "model: {use_attn_mask_compression: true, num_attention_heads: 6}", 8, ValueError,
     ["num_attention_heads 6", "ulysses degree 4"]),
    ("parallelism: {context_parallel: 2, context_parallel_method: ring}", 8, ValueError, ["'ring'"]),
    ("parallelism: {context_parallel: 2, context_parallel_mask_type: full}\nmodel: {use_attn_mask_compression: true}",
     8, NotImplementedError, ["'full'", "causal"]),
    ("parallelism: {context_parallel: 2}", 8, ValueError, ["requires a compressed attention mask"]),
    ("parallelism: {context_parallel: 2}\n"
     "train_dataset: {dataloader: {config: {create_compressed_eod_mask: true, create_attention_mask: true}}}",
     8, ValueError, ["requires a compressed attention mask"]),
    ("parallelism: {pipeline_parallel: 2}\nmodel: {num_hidden_layers: 8}", 8, ValueError,
     ["needs pipeline_parallel_layers_per_stage"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_interleave_num: 2, pipeline_parallel_layers_per_stage: auto}\n"
     "model: {num_hidden_layers: 10}", 8, ValueError, ["num_hidden_layers (10)", "(4)", "explicitly"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_layers_per_stage: ['0-3']}\nmodel: {num_hidden_layers: 8}",
     8, ValueError, ["list of 2 entries"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_layers_per_stage: ['0-3', '5-7']}\n"
     "model: {num_hidden_layers: 8}", 8, ValueError, ["cover layers 0-7"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_layers_per_stage: ['4-7', '0-3']}\n"
     "model: {num_hidden_layers: 8}", 8, ValueError, ["increasing order"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_interleave_num: 2,"
     " pipeline_parallel_layers_per_stage: ['0-1', '2-3']}\nmodel: {num_hidden_layers: 4}", 8, ValueError,
     ["1 range(s)", "interleave_num = 2"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_layers_per_stage: ['0-x', '4-7']}\n"
     "model: {num_hidden_layers: 8}", 8, ValueError, ["'0-x'"]),
    ("parallelism: {pipeline_parallel: 2, pipeline_parallel_layers_per_stage: auto}", 8, ValueError,
     ["num_hidden_layers"]),
    ("parallelism: {tensor_parallel: 2, expert_parallel: 5}", 12, ValueError, ["expert_parallel 5", "6*1*2 = 12"]),
    ("parallelism: {tensor_parallel: 4, expert_parallel: 16}", 8, ValueError, ["expert_parallel 16", "2*1*4 = 8"]),
    ("parallelism: {expert_parallel: 4, moe_token_dispatcher_type: alltoall_deredundancy}", 8, ValueError,
     ["expert_parallel (4) >= npu_nums_per_device (8)"]),
    ("parallelism: {expert_parallel: 6, moe_token_dispatcher_type: alltoall_deredundancy, npu_nums_per_device: 4}",
     6, ValueError, ["expert_parallel (6) to be a multiple of npu_nums_per_device (4)", "whole nodes"]),
    ("parallelism: {moe_token_dispatcher_type: allgather}", 8, ValueError, ["'allgather'"]),
])
def test_violations_raise_naming_fields_and_numbers(yaml_text: str, world: int, exc: type, words: list[str]) -> None:
    with pytest.raises(exc) as info:
        load(yaml_text).resolve(world)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("raw,words", [
    ({"parallelism": {"tensor_paralel": 2}}, ["tensor_paralel", "parallelism"]),
    ({"training": {"batch": 2}}, ["batch", "training"]),
    ({"parallelsim": {}}, ["'parallelsim'", "did you mean 'parallelism'"]),
    ({"train_dataset": {"dataloader": {"config": {"create_compresed_eod_mask": True}}}},
     ["'create_compresed_eod_mask'", "did you mean 'create_compressed_eod_mask'"]),
])
def test_unknown_keys_are_rejected_by_name(raw: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        JobConfig.from_dict(raw)
    assert all(w in str(info.value) for w in words)


def test_yaml_file(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("parallelism:\n  tensor_parallel: 2\ntraining:\n  global_batch_size: 16\n  local_batch_size: 2\n")
    d = JobConfig.from_yaml(str(path)).resolve(4)
    assert (d.dp_shard, d.tp, d.num_accumulation_steps) == (2, 2, 4)
