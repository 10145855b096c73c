# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Atomic, verified sharded checkpoints on 2 gloo ranks.

A save writes each rank's shards, a manifest listing every rank's files with checksums and every
tensor's global shape and dtype, and renames the staging directory; the checkpoint loads under
another layout (bit-exact) and in one process.  Damaged copies (a flipped byte, a truncated file,
a missing file, no manifest, a manifest that is not JSON, a tensor of another shape or dtype)
are each refused with their own message, the same on every rank, and the target tensors are left
untouched.  A save that fails raises on every rank and removes its staging directory."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)


def _values() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(5, 6, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}


def _state(mesh: Any, w_pl: Any, b_pl: Any, *, blank: bool = False, w_shape: Any = None, w_dtype: Any = None) -> Any:
    import torch

    from hp_dtensor import distribute_tensor

    v = _values()
    w = v["w"] if not blank else torch.full(w_shape or (5, 6), -7.0, dtype=w_dtype or torch.float32)
    b = v["b"] if not blank else torch.full((7,), -7.0, dtype=torch.bfloat16)
    return {
        "model": {
            "w": distribute_tensor(w, mesh, w_pl, src_data_rank=None),
            "b": distribute_tensor(b, mesh, b_pl, src_data_rank=None),
        },
        "count": torch.tensor(3 if not blank else 0),
    }


def _save_and_reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch

    from hp_checkpoint.atomic import load_checkpoint, save_checkpoint
    from hp_dtensor import Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    path1 = save_checkpoint(_state(mesh, [Shard(0)], [Shard(0)]), root, 1, extra={"note": "first"}, keep=2)
    path2 = save_checkpoint(_state(mesh, [Shard(0)], [Shard(0)]), root, 2, extra={"note": "second"}, keep=1)
    target = _state(mesh, [Shard(1)], [Replicate()], blank=True)
    manifest = load_checkpoint(target, path2)
    v = _values()
    got_w = target["model"]["w"].full_tensor()
    got_b = target["model"]["b"].full_tensor()
    return {
        "paths": (path1, path2), "extra": dict(manifest.extra), "listing": sorted(os.listdir(root)),
        "equal": bool(torch.equal(got_w, v["w"]) and torch.equal(got_b, v["b"]) and int(target["count"]) == 3),
    }


def test_save_is_complete_and_reshards(pool2: RankPool, tmp_path: Any) -> None:
    import torch

    from hp_checkpoint.atomic import load_checkpoint
    from hp_checkpoint.manifest import verify_checkpoint

    root = str(tmp_path / "ckpt")
    r0, r1 = pool2.run(_save_and_reshard, root)
    assert r0["paths"] == r1["paths"] and r0["paths"][1] == os.path.join(root, "step-00000002")
    assert r0["equal"] and r1["equal"] and r0["extra"] == {"note": "second"}
    assert r0["listing"] == ["step-00000002"]  # keep=1 pruned step 1; no staging directory left
    m = verify_checkpoint(r0["paths"][1])
    assert set(m.files) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # both ranks' files
    assert {k: (v.shape, v.dtype) for k, v in m.tensors.items()} == {
        "model.w": ((5, 6), "float32"), "model.b": ((7,), "bfloat16"), "count": ((), "int64")}
    # one process, plain tensors
    plain = {"model": {"w": torch.zeros(5, 6), "b": torch.zeros(7, dtype=torch.bfloat16)}, "count": torch.tensor(0)}
    load_checkpoint(plain, r0["paths"][1])
    assert torch.equal(plain["model"]["w"], _values()["w"]) and torch.equal(plain["model"]["b"], _values()["b"])


DAMAGES = ("byte", "truncated", "missing", "no-manifest", "bad-json", "shape", "dtype")
MESSAGES = {
    "byte": "file '__1_0.distcp' is corrupted: its sha256",
    "truncated": "file '__0_0.distcp' is truncated",
    "missing": "file '.metadata' is missing",
    "no-manifest": "no manifest.json, so the save that wrote it did not finish",
    "bad-json": "manifest.json is not valid JSON",
    "shape": "tensor 'model.w' is float32 of global shape (5, 6), but it is loaded into float32 of global shape (6, 5)",
    "dtype": "tensor 'model.w' is float32 of global shape (5, 6), but it is loaded into float64",
}


def _damage(kind: str, path: str) -> None:
    if kind == "byte":
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
    elif kind == "truncated":
        os.truncate(os.path.join(path, "__0_0.distcp"), 40)
    elif kind == "missing":
        os.remove(os.path.join(path, ".metadata"))
    elif kind == "no-manifest":
        os.remove(os.path.join(path, "manifest.json"))
    elif kind == "bad-json":
        with open(os.path.join(path, "manifest.json"), "a") as f:
            f.write("}")


def _refused(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hp_checkpoint.atomic import load_checkpoint, save_checkpoint
    from hp_dtensor import Replicate, Shard, init_device_mesh
    from hp_dtensor.layout.shard_boxes import CheckpointError

    mesh = init_device_mesh("cpu", (2,))
    good = save_checkpoint(_state(mesh, [Shard(0)], [Shard(0)]), root, 4)
    out: dict[str, Any] = {}
    for kind in DAMAGES:
        path = os.path.join(root, f"copy-{kind}")
        if rank == 0:
            shutil.copytree(good, path)
            _damage(kind, path)
        dist.barrier()
        shape = (6, 5) if kind == "shape" else None
        dtype = torch.float64 if kind == "dtype" else None
        target = _state(mesh, [Shard(1)], [Replicate()], blank=True, w_shape=shape, w_dtype=dtype)
        try:
            load_checkpoint(target, path)
            out[kind] = ("loaded", "")
        except CheckpointError as e:
            out[kind] = ("CheckpointError", str(e))
        untouched = bool((target["model"]["w"].to_local() == -7).all() and (target["model"]["b"].to_local() == -7).all())
        out[kind + ":untouched"] = untouched
    # a failed save (extra is not JSON) raises everywhere and removes its staging directory
    try:
        save_checkpoint(_state(mesh, [Shard(0)], [Shard(0)]), root, 5, extra={"x": object()})
        out["bad-save"] = ("saved", "")
    except CheckpointError as e:
        out["bad-save"] = ("CheckpointError", str(e))
    out["after-bad-save"] = sorted(n for n in os.listdir(root) if not n.startswith("copy-"))
    dist.barrier()
    save_checkpoint(_state(mesh, [Shard(0)], [Shard(0)]), root, 6, keep=1)
    out["after-prune"] = sorted(n for n in os.listdir(root) if not n.startswith("copy-"))
    return out


def test_damaged_checkpoints_are_refused_on_every_rank(pool2: RankPool, tmp_path: Any, capsys: Any) -> None:
    r0, r1 = pool2.run(_refused, str(tmp_path))
    for kind in DAMAGES:
        assert r0[kind] == r1[kind], (kind, r0[kind], r1[kind])  # one error, the same on every rank
        assert r0[kind][0] == "CheckpointError" and MESSAGES[kind] in r0[kind][1], (kind, r0[kind])
        assert r0[kind + ":untouched"] and r1[kind + ":untouched"], kind
    assert len({r0[k][1] for k in DAMAGES}) == len(DAMAGES)  # each damage has its own message
    assert r0["bad-save"][0] == "CheckpointError" and "TypeError" in r0["bad-save"][1]
    assert r1["bad-save"] == r0["bad-save"]
    assert r0["after-bad-save"] == ["step-00000004"]  # the failed save removed its staging directory
    assert r0["after-prune"] == ["step-00000006"]
    with capsys.disabled():
        print(f"\natomic checkpoints: {len(DAMAGES)} damages refused on 2 ranks, each with its own message")


def test_one_process_without_a_group(tmp_path: Any) -> None:
    """One process, no process group: the same path as the ranks take."""
    import torch

    from hp_checkpoint.atomic import load_checkpoint, save_checkpoint
    from hp_checkpoint.manifest import complete_checkpoints

    root = str(tmp_path)
    path = save_checkpoint({"x": torch.arange(4.0)}, root, 3, extra={"losses": [1.0]})
    target = {"x": torch.zeros(4)}
    assert load_checkpoint(target, path).extra == {"losses": [1.0]} and torch.equal(target["x"], torch.arange(4.0))
    assert [s for s, _ in complete_checkpoints(root)] == [3]
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["tensors"] == {"x": {"shape": [4], "dtype": "float32"}}
    # the directory is plain DCP (plus manifest.json): torch's own converter reads it
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, os.path.join(root, "plain.pt"))
    assert torch.equal(torch.load(os.path.join(root, "plain.pt"), weights_only=True)["x"], torch.arange(4.0))


def _async_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """The writer is held at a gate; meanwhile a training step (with collectives on the default
    group) runs and updates the parameter in place.  Released, the writer commits the values
    of the moment ``save`` was called."""
    import threading

    import torch

    from hp_checkpoint import async_save as ca
    from hp_checkpoint.atomic import load_checkpoint
    from hp_checkpoint.manifest import newest_complete
    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    w = torch.nn.Parameter(distribute_tensor(_values()["w"], mesh, [Shard(0)], src_data_rank=None))
    opt = torch.optim.SGD([w], lr=0.5)
    reached, gate = threading.Event(), threading.Event()

    def hold() -> None:
        reached.set()
        gate.wait(timeout=120)

    ca.before_write = hold
    try:
        ckpt = ca.AsyncCheckpointer()
        before = w.full_tensor().clone()
        ckpt.save({"w": w}, root, 1, extra={"step": 1})
        assert reached.wait(timeout=60)
        steps_while_held = 0
        for _ in range(2):  # training goes on while the writer is blocked
            opt.zero_grad()
            (w * w).sum().backward()  # the loss reduces over both ranks
            opt.step()
            steps_while_held += int(not gate.is_set() and not ckpt.done())
        committed_while_held = newest_complete(root) is not None
        after = w.full_tensor().clone()
        gate.set()
        path = ckpt.wait()
    finally:
        ca.before_write = None
    target = {"w": distribute_tensor(torch.zeros(5, 6), mesh, [Shard(1)], src_data_rank=None)}
    load_checkpoint(target, path)
    return {
        "steps_while_held": steps_while_held, "committed_while_held": committed_while_held,
        "saved_is_before": bool(torch.equal(target["w"].full_tensor(), before)),
        "moved": not bool(torch.equal(after, before)), "path": path,
    }


def test_async_save_does_not_hold_up_training(pool2: RankPool, tmp_path: Any, capsys: Any) -> None:
    r0, r1 = pool2.run(_async_save, str(tmp_path))
    for r in (r0, r1):
        assert r["steps_while_held"] == 2 and not r["committed_while_held"], r
        assert r["moved"] and r["saved_is_before"], r
    assert r0["path"] == r1["path"] == str(tmp_path / "step-00000001")
    with capsys.disabled():
        print("\nasync save: 2 training steps per rank ran while the writer was held; the checkpoint "
              "holds the values at save()")
