# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload,method-assign"
"""HF safetensors export of the MindSpore Qwen3.5 on 2 mccl ranks (tp=2, and FSDP through
``fully_shard``), float32 and bfloat16: the files hold, tensor for tensor and bit for bit, the
source HF weights the torch model wrote and the torch model's own export of the same weights at
the same layout on 2 gloo ranks -- the same files byte for byte, index and ``config.json``
included -- and the torch Qwen3.5 loads them (tp=2) back into its weights.  No rank builds more
whole-tensor bytes than its assigned share (counted at the allocation primitive), boxes move only
by broadcasts between their two ranks, as many bytes as torch's point-to-point sends, and a rank
failing a conversion or a write raises ``RuntimeError`` on every rank with no index written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

ms_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "torch"})
INDEX = "model.safetensors.index.json"


def _torch_model(seed: int, tie: bool, dtype: str):
    import torch

    from hp_models.qwen3_5 import tiny_config

    torch.manual_seed(seed)
    model = tiny_config(tie_word_embeddings=tie).build()
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # non-trivial norms, gates and decays
    return model.to(torch.bfloat16) if dtype == "bfloat16" else model


def _torch_layout(model, layout: str, world: int):
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import apply_fsdp_qwen3_5, parallelize_qwen3_5_tp

    if layout == "tp":
        return parallelize_qwen3_5_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    apply_fsdp_qwen3_5(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    return model


def torch_side(rank: int, world: int, seed: int, tie: bool, dtype: str, layout: str, root: str,
               max_shard_bytes: int | None) -> dict[str, int]:
    """On 2 torch ranks: the source HF files (float32 for MindSpore to load, and in ``dtype``) and
    the torch model's export at ``layout``; the bytes each rank sent."""
    from hp_dtensor import CommDebugMode
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    adapter = Qwen3_5StateDictAdapter(tiny_config(tie_word_embeddings=tie))
    if rank == 0:
        adapter.save_hf_state_dict(_torch_model(seed, tie, "float32").state_dict(), os.path.join(root, "source32"))
        adapter.save_hf_state_dict(_torch_model(seed, tie, dtype).state_dict(), os.path.join(root, "source"))
    model = _torch_layout(_torch_model(seed, tie, dtype), layout, world)
    with CommDebugMode() as comm:
        adapter.save(model, os.path.join(root, "torch"), max_shard_bytes=max_shard_bytes)
    return {"sent": comm.get_comm_bytes().get("send", 0)}


def ms_side(rank: int, world: int, tie: bool, dtype: str, layout: str, root: str,
            max_shard_bytes: int | None) -> dict[str, object]:
    """On 2 MindSpore ranks: the model loaded from the float32 source, cast to ``dtype``,
    parallelized at ``layout`` and exported; what the export built, assigned and moved."""
    import mindspore as ms

    from hp_checkpoint.platform.mindspore.transfer import TRANSFER
    from hp_dtensor import CommDebugMode, DTensor, init_device_mesh
    from hp_dtensor.platform import current
    from hp_fsdp import fully_shard
    from hp_models.qwen3_5.config import tiny_config
    from hp_models.qwen3_5.mindspore import (
        Qwen3_5ForCausalLM,
        load_hf_weights,
        parallelize_qwen3_5_ms_tp,
        save_hf_weights,
    )
    from hp_models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter

    cfg = tiny_config(tie_word_embeddings=tie)
    model = Qwen3_5ForCausalLM(cfg)
    if dtype == "float32":
        load_hf_weights(model, os.path.join(root, "source32"))
    else:  # the float32 weights rounded to bfloat16 by MindSpore (torch's model.to(bfloat16) rounds the same)
        loaded = Qwen3_5StateDictAdapter(cfg).load_hf_state_dict(os.path.join(root, "source32"))
        for key, p in current().state_dict(model).items():
            p.set_dtype(ms.bfloat16)
            p.set_data(loaded[key].astype(ms.bfloat16))
    if layout == "tp":
        parallelize_qwen3_5_ms_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    state = current().state_dict(model)
    # (the local shape through the transfer's view: ``to_local`` has no bfloat16 CPU kernel)
    sharded = sum(1 for v in state.values()
                  if isinstance(v, DTensor) and tuple(TRANSFER.local_of(v).shape) != tuple(v.shape))

    built = [0]  # bytes of whole tensors allocated on this rank, counted at the primitive
    real_empty = TRANSFER.empty

    def counting_empty(shape, name):
        t = real_empty(shape, name)
        built[0] += int(np.prod(shape, dtype=np.int64)) * TRANSFER.itemsize(name)
        return t

    TRANSFER.empty = counting_empty
    try:
        with CommDebugMode() as comm:
            stats = save_hf_weights(model, os.path.join(root, "ms"), max_shard_bytes=max_shard_bytes)
    finally:
        del TRANSFER.empty
    return {
        "built": built[0], "assigned": stats.assigned_bytes, "peak": stats.peak_bytes,
        "largest": stats.plan.largest, "total": stats.plan.total_bytes, "written": list(stats.files_written),
        "comm": sorted(str(k) for k in comm.get_comm_counts()),
        "moved": comm.get_comm_bytes().get("broadcast", 0), "sharded": sharded, "params": len(state),
    }


def torch_reload(rank: int, world: int, seed: int, tie: bool, dtype: str, folder: str) -> bool:
    """The MindSpore export loaded into the torch Qwen3.5 at tp=2 equals the weights it came from."""
    import torch

    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    expected = _torch_model(seed, tie, dtype).state_dict()
    model = _torch_layout(_torch_model(seed + 100, tie, dtype), "tp", world)
    Qwen3_5StateDictAdapter(tiny_config(tie_word_embeddings=tie)).load_into(model, folder)
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return sorted(got) == sorted(expected) and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def _tensors(folder: str) -> dict[str, object]:
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            for k, v in load_file(os.path.join(folder, name)).items():
                assert k not in out, f"{k} twice in {folder}"
                out[k] = v
    return out


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize(
    ("seed", "tie", "dtype", "layout", "max_shard_bytes"),
    [(0, False, "float32", "tp", None), (1, True, "bfloat16", "tp", 300_000),
     (2, True, "float32", "fsdp", 400_000), (3, False, "bfloat16", "fsdp", None)],
)
def test_export_equals_the_torch_export_and_the_source(
    ms_pool: RankPool, torch_pool: RankPool, seed: int, tie: bool, dtype: str, layout: str,
    max_shard_bytes: int | None, tmp_path,
) -> None:
    import torch

    root = str(tmp_path)
    sent = [r["sent"] for r in torch_pool.run(torch_side, seed, tie, dtype, layout, root, max_shard_bytes)]
    runs = ms_pool.run(ms_side, tie, dtype, layout, root, max_shard_bytes)
    ms_dir, torch_dir = os.path.join(root, "ms"), os.path.join(root, "torch")
    source, exported, by_torch = _tensors(os.path.join(root, "source")), _tensors(ms_dir), _tensors(torch_dir)
    assert sorted(exported) == sorted(source) == sorted(by_torch)
    want = getattr(torch, dtype)
    for k, v in source.items():
        assert exported[k].dtype == v.dtype == want and torch.equal(exported[k], v), k
        assert torch.equal(exported[k].view(torch.uint8), v.view(torch.uint8)), f"{k}: bits differ"
        assert torch.equal(by_torch[k].view(torch.uint8), v.view(torch.uint8)), k
    # the same plan on the same world: the same files, byte for byte (index and config too)
    assert _files(ms_dir) == _files(torch_dir)
    with open(os.path.join(ms_dir, INDEX)) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(source)

    total, largest = runs[0]["total"], runs[0]["largest"]
    assert total == sum(v.numel() * v.element_size() for v in source.values())
    for rank, r in enumerate(runs):
        assert r["sharded"] > 0, "the layout shards the parameters"
        written = sum(exported[k].numel() * exported[k].element_size()
                      for k, name in index["weight_map"].items() if name in r["written"])
        assert r["built"] == written == r["assigned"], (rank, r)  # whole only on the writer
        assert r["assigned"] <= total / 2 + largest and r["peak"] <= r["assigned"] + largest < total, (rank, r)
        assert set(r["comm"]) <= {"broadcast", "all_gather_object"}, (rank, r["comm"])
    # each box is one broadcast between its two ranks (both count it): torch's sends, byte for byte
    assert runs[0]["moved"] == runs[1]["moved"] == sum(sent), (runs[0]["moved"], runs[1]["moved"], sent)
    assert torch_pool.run(torch_reload, seed, tie, dtype, ms_dir) == [True, True]
    print(f"{layout} {dtype} tie={tie}: {len(source)} tensors, {total} B, {len(index['weight_map'])} in "
          f"{len(set(index['weight_map'].values()))} files; built {[r['built'] for r in runs]}, peaks "
          f"{[r['peak'] for r in runs]}, moved {runs[0]['moved']} B (torch sent {sent})")


def ms_failing(rank: int, world: int, root: str, what: str) -> str:
    from hp_checkpoint.platform.mindspore.shard_files import SHARD_FILES
    from hp_dtensor import init_device_mesh
    from hp_dtensor.platform import current
    from hp_models.qwen3_5.config import tiny_config
    from hp_models.qwen3_5.mindspore import (
        Qwen3_5ForCausalLM,
        Qwen3_5MsStateDictAdapter,
        load_hf_weights,
        parallelize_qwen3_5_ms_tp,
    )

    cfg = tiny_config()
    model = Qwen3_5ForCausalLM(cfg)
    load_hf_weights(model, os.path.join(root, "source32"))
    parallelize_qwen3_5_ms_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    adapter = Qwen3_5MsStateDictAdapter(cfg)
    real_convert, real_write = adapter.to_hf, SHARD_FILES.write

    def broken(parts):
        if "model.norm.weight" in parts:
            raise RuntimeError("conversion bug")
        return real_convert(parts)

    def failing_write(tensors, file):
        if rank == 1:
            raise OSError(28, "No space left on device")
        real_write(tensors, file)

    if what == "convert":
        adapter.to_hf = broken
    else:
        SHARD_FILES.write = failing_write
    try:
        adapter.export(current().state_dict(model), os.path.join(root, what))
    except RuntimeError as e:
        return str(e)
    finally:
        if what == "write":
            del SHARD_FILES.write
    return "no error"


def test_a_failing_rank_is_raised_on_every_rank(ms_pool: RankPool, torch_pool: RankPool, tmp_path) -> None:
    root = str(tmp_path)
    torch_pool.run(torch_side, 5, False, "float32", "tp", root, None)
    for what, match in (("convert", "converting 'model.norm.weight': RuntimeError: conversion bug"),
                        ("write", "rank 1 could not write model-0000")):
        for msg in ms_pool.run(ms_failing, root, what):
            assert match in msg and "No space" in msg if what == "write" else match in msg, (what, msg)
        assert not os.path.exists(os.path.join(root, what, INDEX)), what
