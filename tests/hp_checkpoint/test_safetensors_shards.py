# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""The safetensors-shards checkpoint: saved under one layout on 4 gloo ranks, loaded under every
other (and in one process) bit-equal to the tensors it was made from, each rank reading exactly
the elements it holds; the files alone (safetensors + manifest, no library) rebuild every tensor;
a damaged, truncated, missing or unfinished checkpoint and a wrong shape are refused with their
own messages on every rank."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)

SHAPES = {"w.uneven": ((7, 5), "float32"), "w.even": ((8, 6), "bfloat16"), "b": ((3,), "float32"),
          "ids": ((9, 2), "int64"), "scalar": ((), "float32"), "empty": ((0, 4), "float32")}
# mesh ("2x2" / "4"), placements per tensor rank (1-d tensors use the first entry's Shard dims only)
LAYOUTS = {
    "s0s1": ("2x2", ("S0", "S1")),
    "rs0": ("2x2", ("R", "S0")),
    "s0s0": ("2x2", ("S0", "S0")),
    "tp4_s1": ("4", ("S1",)),
    "plain": (None, ()),
}


def _full() -> dict[str, Any]:
    import torch

    from hp_checkpoint.platform.torch.transfer import to_dtype

    g = torch.Generator().manual_seed(15)
    out = {}
    for k, (shape, dtype) in SHAPES.items():
        out[k] = (torch.randn(shape, generator=g) * 1000).to(to_dtype(dtype))
    return out


def _state(layout: str, fill: str) -> dict[str, Any]:
    import torch

    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    full = _full()
    if fill == "zeros":
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    mesh_kind, places = LAYOUTS[layout]
    if mesh_kind is None:
        return full
    mesh = init_device_mesh("cpu", (2, 2) if mesh_kind == "2x2" else (4,))
    out = {}
    for k, v in full.items():
        ps = []
        for p in places:
            if p == "R" or v.ndim == 0 or (p == "S1" and v.ndim < 2):
                ps.append(Replicate())
            else:
                ps.append(Shard(int(p[1])))
        out[k] = distribute_tensor(v, mesh, ps)
    return out


def _save_then_load_all(rank: int, world: int, root: str, save_layout: str) -> dict[str, Any]:
    import torch

    from hp_checkpoint.platform.torch.shard_files import SHARD_FILES
    from hp_checkpoint.safetensors_shards import load_shards, save_shards

    path = save_shards(_state(save_layout, "values"), root, 7, extra={"layout": save_layout})
    expected = _full()
    results = {}
    for load_layout in LAYOUTS:
        target = _state(load_layout, "zeros")
        read = [0]
        real = SHARD_FILES.read

        def counting(handle: Any, key: str, start: Any, stop: Any, real: Any = real, read: Any = read) -> Any:
            t = real(handle, key, start, stop)
            read[0] += t.numel() * t.element_size()
            return t

        SHARD_FILES.read = counting
        try:
            manifest = load_shards(target, path)
        finally:
            del SHARD_FILES.read
        held = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size() for v in target.values())
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in target.items()}
        results[load_layout] = (
            all(torch.equal(full[k], expected[k]) and full[k].dtype == expected[k].dtype for k in expected),
            read[0] == held,
            manifest.extra["user"] == {"layout": save_layout},
        )
    return {"results": results, "path": path, "root_entries": sorted(os.listdir(root))}


@pytest.mark.parametrize("save_layout", ["s0s1", "rs0", "tp4_s1", "plain"])
def test_save_under_one_layout_load_under_every_other(pool4: RankPool, save_layout: str) -> None:
    root = tempfile.mkdtemp()
    try:
        out = pool4.run(_save_then_load_all, root, save_layout)
        for rank, r in enumerate(out):
            for load_layout, (equal, read_exact, extra_ok) in r["results"].items():
                assert equal, f"rank {rank}: saved {save_layout}, loaded {load_layout}: values differ"
                assert read_exact, f"rank {rank}: {save_layout} -> {load_layout} read more than its slice"
                assert extra_ok
            assert r["root_entries"] == ["step-00000007"]  # committed; no staging directory left
        _one_process_checks(out[0]["path"])
        print(f"saved {save_layout} on 4 ranks -> loaded under {len(LAYOUTS)} layouts x {len(SHAPES)} tensors + "
              f"one process: bit-equal, reads exact")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _one_process_checks(path: str) -> None:
    """No process group: the library loads it into plain tensors, and the files alone rebuild it."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from hp_checkpoint.safetensors_shards import load_shards

    expected = _full()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    load_shards(target, path)
    assert all(torch.equal(target[k], expected[k]) for k in expected)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["kind"] == "safetensors-shards" and manifest["framework"] == "torch"
    for fqn, entry in manifest["tensors"].items():
        if entry["dtype"] == "bfloat16":
            continue  # numpy has no bfloat16
        whole = np.zeros(entry["shape"], dtype=entry["dtype"])
        for box in manifest["extra"]["boxes"][fqn]:
            with safe_open(os.path.join(path, box["file"]), framework="np") as f:
                data = f.get_tensor(box["key"])
            whole[tuple(slice(o, o + s) for o, s in zip(box["offsets"], box["sizes"]))] = data
        assert np.array_equal(whole, expected[fqn].numpy()), fqn


# ----- refusals -----


def _load_damaged(rank: int, world: int, root: str, damage: str) -> str:
    import torch.distributed as dist

    from hp_checkpoint.safetensors_shards import load_shards, save_shards
    from hp_dtensor.layout.shard_boxes import CheckpointError

    path = save_shards(_state("s0s1", "values"), root, 3)
    if rank == 0:
        victim = os.path.join(path, "shard-rank00001.safetensors")
        if damage == "corrupt":
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) - 5)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x40]))
        elif damage == "truncate":
            os.truncate(victim, os.path.getsize(victim) - 8)
        elif damage == "missing":
            os.remove(victim)
        elif damage == "no_manifest":
            os.remove(os.path.join(path, "manifest.json"))
    dist.barrier()
    target = _state("tp4_s1", "zeros")
    if damage == "wrong_shape":
        import torch

        target["b"] = torch.zeros(4)
    if damage == "missing_tensor":
        import torch

        target["extra.w"] = torch.zeros(2)
    try:
        load_shards(target, path)
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "damage,message",
    [
        ("corrupt", "file 'shard-rank00001.safetensors' is corrupted"),
        ("truncate", "file 'shard-rank00001.safetensors' is truncated"),
        ("missing", "file 'shard-rank00001.safetensors' is missing"),
        ("no_manifest", "no manifest.json, so the save that wrote it did not finish"),
        ("wrong_shape", "tensor 'b' is float32 of global shape (3,), but it is loaded into float32 of global shape (4,)"),
        ("missing_tensor", "has no tensor 'extra.w'"),
    ],
)
def test_damaged_checkpoints_are_refused_on_every_rank(pool4: RankPool, damage: str, message: str) -> None:
    root = tempfile.mkdtemp()
    try:
        for msg in pool4.run(_load_damaged, root, damage):
            assert message in msg, msg
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _save_failing(rank: int, world: int, root: str, how: str) -> str:
    import torch

    from hp_checkpoint.platform.torch.shard_files import SHARD_FILES
    from hp_checkpoint.safetensors_shards import save_shards
    from hp_dtensor.layout.shard_boxes import CheckpointError

    state = _state("s0s1", "values")
    if how == "bad_name":
        state["a|b"] = torch.zeros(2)
    if how == "disk_full" and rank == 2:
        def full(tensors: Any, path: str) -> None:
            raise OSError(28, "No space left on device")

        SHARD_FILES.write = full
    try:
        save_shards(state, root, 9)
    except CheckpointError as e:
        return str(e)
    finally:
        SHARD_FILES.__dict__.pop("write", None)
    return "no error"


@pytest.mark.parametrize("how,message", [("bad_name", "tensor name 'a|b' contains '|'"),
                                         ("disk_full", "rank 2 could not write shard-rank00002.safetensors: "
                                                       "No space left on device; the disk is full: free space")])
def test_failed_save_is_raised_on_every_rank_and_commits_nothing(pool4: RankPool, how: str, message: str) -> None:
    from hp_checkpoint.manifest import complete_checkpoints

    root = tempfile.mkdtemp()
    try:
        for msg in pool4.run(_save_failing, root, how):
            assert message in msg, msg
        assert complete_checkpoints(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_bad_names_are_refused() -> None:
    from hp_checkpoint.safetensors_shards import box_key
    from hp_dtensor.layout.shard_boxes import CheckpointError

    assert box_key("a.b", (0, 4)) == "a.b|0,4" and box_key("s", ()) == "s|"
    with pytest.raises(CheckpointError, match=r"'a\|b' contains '\|'"):
        box_key("a|b", (0,))
