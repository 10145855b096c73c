# mypy: disable-error-code="no-untyped-def"
"""Every row of the parallelism constraints table, violated once: the trainer's own layout
(``hp_models.job.plan``) raises the documented exception naming the offending value, and the train
command stops with that message as one ``error:`` line before any rank starts (nothing written).
Rows a model or sequence length decides (heads over tp, the sequence over SP ranks) are the
command's checks: ``plan`` accepts them and the command refuses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hp_models import train
from hp_models.job import ModelSizes, Overrides, plan, read_job_file

TINY = ModelSizes(num_attention_heads=8, num_hidden_layers=4)
CAUSAL = {"model": {"use_attn_mask_compression": True}}
SEED_CP_TEXT = ("Context parallel (context_parallel > 1) requires a compressed attention mask. Please enable "
                "use_attn_mask_compression for non-eod data, or create_compressed_eod_mask for eod data.")


def job(parallelism: dict[str, Any], training: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    return {"parallelism": parallelism, "training": training or {"global_batch_size": 8}, **sections}


# (row of the table / what is violated, job, ranks, extra flags, exception plan raises or None, words)
ROWS: list[tuple[str, dict[str, Any], int, list[str], type[Exception] | None, list[str]]] = [
    # world = dp_replicate * dp_shard * cp * tp * pp
    ("world/not-a-multiple-of-tp*pp*cp", job({"tensor_parallel": 2, "context_parallel": 2}, **CAUSAL), 6, [],
     ValueError, ["world_size 6 is not divisible", "2*1*2 = 4"]),
    # data_parallel = world // (tp * pp * cp) >= 1 and divisible by dp_shard
    ("data-parallel/below-one", job({"tensor_parallel": 8}), 4, [], ValueError,
     ["data_parallel = world_size // (tensor_parallel*pipeline_parallel*context_parallel) = 4 // (8*1*1) = 0",
      "at least 8 ranks"]),
    ("data-parallel/not-divisible-by-dp-shard", job({"data_parallel_shard": 3}), 4, [], ValueError,
     ["data_parallel (4", "not divisible by data_parallel_shard 3"]),
    ("data-parallel/dp-shard-zero", job({"data_parallel_shard": 0}), 4, [], ValueError,
     ["data_parallel_shard must be -1 or a positive int, got 0"]),
    # data_parallel * local_batch_size <= global_batch_size
    ("batch/local-times-dp-exceeds-global", job({}, {"global_batch_size": 4, "local_batch_size": 2}), 4, [],
     ValueError, ["data_parallel * local_batch_size = 4 * 2 = 8 exceeds global_batch_size 4"]),
    ("batch/global-not-a-multiple", job({}, {"global_batch_size": 10, "local_batch_size": 2}), 4, [],
     ValueError, ["global_batch_size 10 is not a multiple of data_parallel * local_batch_size = 4 * 2 = 8"]),
    # TP: a positive size that divides the model; SP follows TP, with no switch of its own
    ("tp/zero", job({"tensor_parallel": 0}), 4, [], ValueError, ["tensor_parallel must be a positive int, got 0"]),
    ("tp/does-not-divide-heads", job({"tensor_parallel": 3}), 3, [], None,
     ["tp=3 does not divide", "num_attention_heads=8"]),
    ("sp/no-switch", job({"tensor_parallel": 2, "sequence_parallel": False}), 4, [], ValueError,
     ["parallelism.sequence_parallel (False) is not a setting", "follows tensor_parallel"]),
    ("sp/sequence-not-divisible-by-tp", job({"tensor_parallel": 2}), 4, ["--seq-len", "15"], None,
     ["--seq-len 15 must be divisible by --tp 2"]),
    # CP methods
    ("cp/ulysses-degree-not-cp", job({"context_parallel": 4, "context_parallel_method": "ulysses",
                                      "ulysses_degree_in_cp": 2}, **CAUSAL), 4, [], ValueError,
     ["ulysses_degree_in_cp == context_parallel", "ulysses_degree_in_cp 2 and context_parallel 4"]),
    ("cp/hybrid-degree-missing", job({"context_parallel": 4, "context_parallel_method": "hybrid"}, **CAUSAL), 4, [],
     ValueError, ["context_parallel_method hybrid needs ulysses_degree_in_cp to be set"]),
    ("cp/hybrid-degree-not-below-cp", job({"context_parallel": 4, "context_parallel_method": "hybrid",
                                           "ulysses_degree_in_cp": 4}, **CAUSAL), 4, [], ValueError,
     ["1 < ulysses_degree_in_cp < context_parallel", "ulysses_degree_in_cp 4 and context_parallel 4"]),
    ("cp/hybrid-degree-not-dividing", job({"context_parallel": 4, "context_parallel_method": "hybrid",
                                           "ulysses_degree_in_cp": 3}, **CAUSAL), 4, [], ValueError,
     ["context_parallel % ulysses_degree_in_cp == 0", "ulysses_degree_in_cp 3"]),
    ("cp/ulysses-async-heads", job({"context_parallel": 3, "context_parallel_method": "ulysses",
                                    "context_parallel_async": True}, **CAUSAL), 3, [], ValueError,
     ["num_attention_heads % ulysses_degree == 0", "num_attention_heads 8 and ulysses degree 3"]),
    ("cp/unknown-method", job({"context_parallel": 2, "context_parallel_method": "ring"}, **CAUSAL), 4, [],
     ValueError, ["context_parallel_method must be one of", "'ring'"]),
    # CP needs a compressed mask, and its input preparation only the causal mask type
    ("cp-mask/no-compression", job({"context_parallel": 2}), 4, [], ValueError, [SEED_CP_TEXT]),
    ("cp-mask/eod-with-dense-mask", job({"context_parallel": 2}, train_dataset={"dataloader": {"config": {
        "create_compressed_eod_mask": True, "create_attention_mask": True}}}), 4, [], ValueError, [SEED_CP_TEXT]),
    ("cp-mask/type-not-causal", job({"context_parallel": 2, "context_parallel_mask_type": "full"}, **CAUSAL), 4, [],
     NotImplementedError, ["context_parallel_mask_type 'full' is not supported", "only 'causal'"]),
    # EP divides dp_shard * cp * tp; deredundancy needs ep >= npu_nums_per_device (whole nodes)
    ("ep/not-dividing-dp-shard*cp*tp", job({"tensor_parallel": 2, "expert_parallel": 4}), 2, ["--config", "tiny-moe"],
     ValueError, ["expert_parallel 4 must divide dp_shard*cp*tp = 1*1*2 = 2"]),
    ("ep/deredundancy-below-npus-per-device", job({"expert_parallel": 2, "moe_token_dispatcher_type":
                                                   "alltoall_deredundancy"}), 4, ["--config", "tiny-moe"],
     ValueError, ["alltoall_deredundancy needs expert_parallel (2) >= npu_nums_per_device (8)"]),
    ("ep/deredundancy-not-whole-nodes", job({"expert_parallel": 4, "moe_token_dispatcher_type":
                                             "alltoall_deredundancy", "npu_nums_per_device": 3}), 4,
     ["--config", "tiny-moe"], ValueError, ["expert_parallel (4) to be a multiple of npu_nums_per_device (3)"]),
    ("ep/unknown-dispatcher", job({"expert_parallel": 2, "moe_token_dispatcher_type": "allgather"}), 4,
     ["--config", "tiny-moe"], ValueError, ["moe_token_dispatcher_type must be one of", "'allgather'"]),
    # PP: a layer placement that covers the model
    ("pp/layers-per-stage-missing", job({"pipeline_parallel": 2}), 2, [], ValueError,
     ["pipeline_parallel > 1 needs pipeline_parallel_layers_per_stage"]),
    ("pp/auto-not-dividing", job({"pipeline_parallel": 2, "pipeline_parallel_interleave_num": 2,
                                  "pipeline_parallel_layers_per_stage": "auto"}, model={"num_hidden_layers": 6}), 4,
     [], ValueError, ["auto needs num_hidden_layers (6) divisible by pipeline_parallel*interleave_num (2*2 = 4)"]),
]


@pytest.mark.parametrize("row,raw,nproc,flags,exc,words", ROWS, ids=[r[0] for r in ROWS])
def test_each_constraint_fails_before_any_rank_starts(row, raw, nproc, flags, exc, words, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = ["--job", str(path), "--nproc", str(nproc), "--out-dir", str(tmp_path / "out"), *flags]
    # reading the job and laying it out alone: the documented exception, naming the value
    args = train.parse_args(argv)

    def layout() -> None:
        raw = read_job_file(str(path))
        plan(raw, train.overrides(args), train.model_sizes(train.load_config(args, raw)), nproc)

    if exc is None:
        layout()  # the command's own check (model sizes, sequence length) refuses it
    else:
        with pytest.raises(exc) as info:
            layout()
        assert all(w in str(info.value) for w in words), (row, str(info.value))
    # the command: one error line, before any rank starts or anything is written
    with pytest.raises(SystemExit) as stop:
        train.main(argv)
    msg = str(stop.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and all(w in msg for w in words), (row, msg)
    assert not (tmp_path / "out").exists()


def test_every_row_of_the_table_is_covered() -> None:
    rows = {r[0].split("/")[0] for r in ROWS}
    assert rows == {"world", "data-parallel", "batch", "tp", "sp", "cp", "cp-mask", "ep", "pp"}
    print(f"\n{len(ROWS)} violations over {len(rows)} rules")


def test_data_parallel_shard_minus_one_takes_every_data_parallel_rank() -> None:
    """``-1``: dp_shard = world // (tp * pp * cp), no replicas; a positive number smaller than
    that makes replicas (HSDP), dp_replicate = data_parallel // dp_shard."""
    for world, par, want in [(4, {}, (1, 4)), (8, {"tensor_parallel": 2}, (1, 4)), (8, {"data_parallel_shard": 2}, (4, 2)),
                             (16, {"data_parallel_shard": 8}, (2, 8)), (8, {"context_parallel": 2}, (1, 4))]:
        lay = plan({**CAUSAL, "parallelism": par}, Overrides(global_batch_size=16), TINY, world)
        assert (lay.dims.dp_replicate, lay.dims.dp_shard) == want, (world, par)
