# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""HF safetensors export at scale: under TP, FSDP, FSDP+TP and replicated TP on 2 and 4 gloo ranks
the shards and index hold exactly the one-process model's HF state dict (bit-equal, read back by
``safetensors`` and by transformers' ``from_pretrained``), and no rank builds more whole-tensor
bytes than its assigned share plus the largest tensor (counted at the allocation primitive)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=300)
pool4 = rank_pool_fixture(4, timeout=300)


def _model(seed: int) -> Any:
    import torch

    from hp_models.qwen3_5 import tiny_config

    torch.manual_seed(seed)
    m = tiny_config().build()
    m.init_weights()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m


def _layout(model: Any, layout: str, world: int) -> Any:
    """``tp``: tp=world; ``fsdp``: dp_shard=world; ``fsdp_tp``: (2, world/2); ``tp_rows``: tp=2
    on each row of a (world/2, 2) mesh, every row a replica."""
    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import apply_fsdp_qwen3_5, parallelize_qwen3_5_tp

    if layout == "tp":
        return parallelize_qwen3_5_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    if layout == "fsdp":
        apply_fsdp_qwen3_5(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
        return model
    mesh = init_device_mesh("cpu", (2, world // 2) if layout == "fsdp_tp" else (world // 2, 2),
                            mesh_dim_names=("fsdp", "tp"))
    parallelize_qwen3_5_tp(model, mesh["tp"])
    if layout == "fsdp_tp":
        apply_fsdp_qwen3_5(model, mesh["fsdp"])
    return model


def _export_case(rank: int, world: int, folder: str, layout: str, max_shard_bytes: int | None) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from hp_checkpoint.platform.torch.transfer import TRANSFER
    from hp_dtensor import CommDebugMode
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    adapter = Qwen3_5StateDictAdapter(tiny_config())
    reference = adapter.to_hf(_model(seed=11).state_dict())  # the one-process model, HF names
    model = _layout(_model(seed=11), layout, world)

    built = [0]  # bytes of whole tensors allocated on this rank, counted at the primitive
    real_empty = TRANSFER.empty

    def counting_empty(shape: Any, dtype: str) -> Any:
        t = real_empty(shape, dtype)
        built[0] += t.numel() * t.element_size()
        return t

    TRANSFER.empty = counting_empty
    try:
        with CommDebugMode() as comm:
            stats = adapter.save(model, folder, max_shard_bytes=max_shard_bytes)
    finally:
        del TRANSFER.empty
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    on_disk = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    loaded: dict[str, Any] = {}
    where: dict[str, str] = {}
    for name in files:
        for k, v in load_file(os.path.join(folder, name)).items():
            assert k not in loaded, f"{k} in two files"
            loaded[k], where[k] = v, name
    mine = {k for k, fname in where.items() if fname in stats.files_written}
    total = sum(v.numel() * v.element_size() for v in reference.values())
    largest = max(v.numel() * v.element_size() for v in reference.values())
    return {
        "files_ok": files == on_disk and all(f"-of-{len(files):05d}" in n for n in files),
        "map_ok": index["weight_map"] == where and sorted(loaded) == sorted(reference),
        "total_size_ok": index["metadata"]["total_size"] == total,
        "equal": all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in reference.items()),
        "built": built[0],
        "mine_bytes": sum(loaded[k].numel() * loaded[k].element_size() for k in mine),
        "assigned": stats.assigned_bytes,
        "peak": stats.peak_bytes,
        "total": total,
        "largest": largest,
        "nfiles": len(files),
        # only point-to-point sends and one metadata gather: no rank all-gathers a tensor
        "comm": sorted(comm.get_comm_counts()),
        "sent": comm.get_comm_bytes().get("send", 0),
    }


def _check_export(results: list[dict[str, Any]], world: int) -> None:
    total, largest = results[0]["total"], results[0]["largest"]
    assert sum(r["mine_bytes"] for r in results) == total  # every tensor written by exactly one rank
    for rank, r in enumerate(results):
        assert r["files_ok"] and r["map_ok"] and r["total_size_ok"], (rank, r)
        assert r["equal"], f"rank {rank}: exported tensors differ from the one-process model"
        # the allocations are exactly this rank's written tensors, and bounded by a fair share
        assert r["built"] == r["mine_bytes"] == r["assigned"], (rank, r)
        assert r["assigned"] <= total / world + largest, (rank, r)
        assert r["peak"] <= r["assigned"] + largest, (rank, r)
        assert r["peak"] < total, (rank, r)
        assert set(r["comm"]) <= {"send", "all_gather_object"}, (rank, r["comm"])
        assert r["sent"] <= total - r["built"], (rank, r)  # a rank sends at most what others write
    print(f"world={world}: total {total} B, largest {largest} B, per-rank built {[r['built'] for r in results]}, "
          f"peaks {[r['peak'] for r in results]}, sent {[r['sent'] for r in results]}, files {results[0]['nfiles']}")


@pytest.mark.parametrize("layout,max_shard_bytes", [("tp", None), ("fsdp", 400_000)])
def test_export_on_2_ranks(pool2: RankPool, layout: str, max_shard_bytes: int | None) -> None:
    folder = tempfile.mkdtemp()
    try:
        _check_export(pool2.run(_export_case, folder, layout, max_shard_bytes, timeout=300), 2)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("layout,max_shard_bytes", [("tp", None), ("fsdp_tp", 300_000), ("tp_rows", None)])
def test_export_on_4_ranks(pool4: RankPool, layout: str, max_shard_bytes: int | None) -> None:
    folder = tempfile.mkdtemp()
    try:
        _check_export(pool4.run(_export_case, folder, layout, max_shard_bytes, timeout=300), 4)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _export_then_reload(rank: int, world: int, folder: str) -> bool:
    """Export from FSDP x TP, import into tp=4 and into a one-process model: same weights."""
    import torch

    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    adapter = Qwen3_5StateDictAdapter(tiny_config())
    expected = _model(seed=3).state_dict()
    adapter.save(_layout(_model(seed=3), "fsdp_tp", world), folder, max_shard_bytes=250_000)
    tp4 = _layout(_model(seed=8), "tp", world)
    adapter.load_into(tp4, folder)
    single = _model(seed=9)
    adapter.load_into(single, folder)
    full = {k: v.full_tensor() for k, v in tp4.state_dict().items()}
    return all(torch.equal(full[k], v) for k, v in expected.items()) and all(
        torch.equal(v, expected[k]) for k, v in single.state_dict().items()
    )


def test_fsdp_tp_export_imports_under_tp4_and_one_process(pool4: RankPool) -> None:
    folder = tempfile.mkdtemp()
    try:
        assert pool4.run(_export_then_reload, folder, timeout=300) == [True] * 4
        # and transformers reads the same shards (index + sharded files) into the same values
        from safetensors.torch import load_file
        from transformers import Qwen3_5ForCausalLM as HF

        loaded: Any = HF.from_pretrained(folder, output_loading_info=True)
        hf, info = loaded
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        stored: dict[str, Any] = {}
        for n in os.listdir(folder):
            if n.endswith(".safetensors"):
                stored.update(load_file(os.path.join(folder, n)))
        import torch

        hf_sd = hf.state_dict()
        assert all(torch.equal(hf_sd[k], v) for k, v in stored.items())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _export_failing_on_one_rank(rank: int, world: int, folder: str) -> str:
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    adapter = Qwen3_5StateDictAdapter(tiny_config())
    real = adapter.to_hf

    def broken(parts: dict[str, Any]) -> dict[str, Any]:
        if "model.norm.weight" in parts:
            raise RuntimeError("conversion bug")
        return real(parts)

    adapter.to_hf = broken
    try:
        adapter.save(_layout(_model(seed=2), "tp", world), folder)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_writer_failure_is_raised_on_every_rank(pool2: RankPool) -> None:
    folder = tempfile.mkdtemp()
    try:
        for msg in pool2.run(_export_failing_on_one_rank, folder, timeout=120):
            assert "converting 'model.norm.weight': RuntimeError: conversion bug" in msg, msg
        assert not os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _export_write_failing_on_rank_1(rank: int, world: int, folder: str) -> str:
    from hp_checkpoint.platform.torch.shard_files import SHARD_FILES
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    real = SHARD_FILES.write

    def failing(tensors: Any, file: str) -> None:
        if rank == 1:
            raise OSError(28, "No space left on device")
        real(tensors, file)

    SHARD_FILES.write = failing
    try:
        Qwen3_5StateDictAdapter(tiny_config()).save(_layout(_model(seed=2), "tp", world), folder)
    except RuntimeError as e:
        return str(e)
    finally:
        del SHARD_FILES.write
    return "no error"


def test_a_write_failure_off_rank_0_is_raised_on_every_rank(pool2: RankPool) -> None:
    """Rank 0 wrote its file and would write the index: it must learn of rank 1's failure first."""
    folder = tempfile.mkdtemp()
    try:
        for msg in pool2.run(_export_write_failing_on_rank_1, folder, timeout=120):
            assert "rank 1 could not write model-00002-of-00002.safetensors: OSError" in msg, msg
        assert not os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----- import refuses what does not fit, naming it (one process) -----


def _one_process_export(folder: str) -> Any:
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter, tiny_config

    adapter = Qwen3_5StateDictAdapter(tiny_config())
    stats = adapter.save(_model(seed=4), folder, max_shard_bytes=500_000)
    assert stats.plan.world == 1 and len(stats.files_written) == len(stats.plan.files) > 1
    return adapter


def test_missing_shard_file_is_refused_naming_it(tmp_path) -> None:
    adapter = _one_process_export(str(tmp_path))
    with open(tmp_path / "model.safetensors.index.json") as f:
        gone = json.load(f)["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / gone)
    with pytest.raises(FileNotFoundError, match=rf"names files that are missing: \['{gone}'\]"):
        adapter.load_into(_model(seed=1), str(tmp_path))


def test_missing_tensor_is_refused_naming_it(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    adapter = _one_process_export(str(tmp_path))
    with open(tmp_path / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    victim = "model.layers.1.linear_attn.in_proj_qkv.weight"
    tensors = load_file(str(tmp_path / wm[victim]))
    del tensors[victim]
    save_file(tensors, str(tmp_path / wm[victim]), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"no tensor 'model.layers.1.linear_attn.in_proj_qkv.weight' \(for "
                                       r"'model.layers.1.linear_attn.in_proj_q.weight'\)"):
        adapter.load_into(_model(seed=1), str(tmp_path))


def test_wrong_global_shape_is_refused_naming_it(tmp_path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    adapter = _one_process_export(str(tmp_path))
    with open(tmp_path / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    victim = "model.layers.0.mlp.down_proj.weight"
    tensors = load_file(str(tmp_path / wm[victim]))
    tensors[victim] = torch.zeros(tensors[victim].shape[0], tensors[victim].shape[1] + 1)
    save_file(tensors, str(tmp_path / wm[victim]), metadata={"format": "pt"})
    model = _model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight'.*global shape \(256, 769\)"):
        adapter.load_into(model, str(tmp_path))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_stale_single_file_export_is_replaced(tmp_path) -> None:
    """A folder holding an older ``model.safetensors`` is cleaned, so a load never mixes the two."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    adapter = _one_process_export(str(tmp_path))
    assert not (tmp_path / "model.safetensors").exists()
    model = _model(seed=1)
    adapter.load_into(model, str(tmp_path))
    assert all(torch.equal(v, _model(seed=4).state_dict()[k]) for k, v in model.state_dict().items())
