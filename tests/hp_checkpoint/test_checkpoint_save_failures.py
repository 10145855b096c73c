# mypy: disable-error-code="attr-defined,no-untyped-def,method-assign"
"""Saves that the disk refuses, on 2 gloo ranks, in both sharded formats: a checkpoint root that
is a file, and a full disk on one rank only.  Every rank raises the same ``CheckpointError``
naming the path and what to do (no rank is left waiting), and a failed save removes its staging
directory, so retries on a full disk do not pile them up."""

from __future__ import annotations

import errno
import os
from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=90)


def _state() -> dict[str, Any]:
    import torch

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    return {"w": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)], src_data_rank=None)}


def _try(fn: Any) -> str:
    from hp_dtensor.layout.shard_boxes import CheckpointError

    try:
        fn()
        return "saved"
    except CheckpointError as e:
        return f"CheckpointError: {e}"


def _root_is_a_file(rank: int, world: int, base: str) -> dict[str, str]:
    import torch.distributed as dist

    from hp_checkpoint.atomic import save_checkpoint
    from hp_checkpoint.safetensors_shards import save_shards

    root = os.path.join(base, "ckpt-file")
    if rank == 0:
        with open(root, "w") as f:
            f.write("not a directory")
    dist.barrier()
    return {"dcp": _try(lambda: save_checkpoint(_state(), root, 1)),
            "shards": _try(lambda: save_shards(_state(), root, 1))}


def test_a_root_that_is_a_file_fails_on_every_rank(pool2: RankPool, tmp_path: Any) -> None:
    r0, r1 = pool2.run(_root_is_a_file, str(tmp_path))
    assert r0 == r1, (r0, r1)
    root = str(tmp_path / "ckpt-file")
    for kind in ("dcp", "shards"):
        assert r0[kind].startswith("CheckpointError:") and root in r0[kind] and "is a file" in r0[kind], r0[kind]


def _full_disk_on_rank_1(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hp_checkpoint.atomic import save_checkpoint
    from hp_checkpoint.platform.torch import dcp as torch_dcp
    from hp_checkpoint.safetensors_shards import save_shards, shard_file_primitives

    save_checkpoint(_state(), root, 1)
    files = shard_file_primitives()
    real_write_data, real_write = torch_dcp._SealingWriter.write_data, files.write

    def no_space(path: str) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def full_dcp(self: Any, plan: Any, planner: Any) -> Any:
        raise no_space(os.path.join(str(self.path), "__1_0.distcp"))

    def full_shards(tensors: Any, path: str) -> None:
        raise no_space(path)

    out: dict[str, Any] = {}
    if rank == 1:
        torch_dcp._SealingWriter.write_data = full_dcp
        files.write = full_shards
    try:
        out["dcp"] = [_try(lambda: save_checkpoint(_state(), root, 2)) for _ in range(2)]  # a retry too
        dist.barrier()
        out["dcp-left"] = sorted(os.listdir(root))
        out["shards"] = [_try(lambda: save_shards(_state(), os.path.join(root, "st"), 2)) for _ in range(2)]
        dist.barrier()
        out["shards-left"] = sorted(os.listdir(os.path.join(root, "st")))
    finally:
        torch_dcp._SealingWriter.write_data, files.write = real_write_data, real_write
    return out


def test_a_full_disk_on_one_rank_fails_everywhere_and_leaves_no_staging(pool2: RankPool, tmp_path: Any) -> None:
    r0, r1 = pool2.run(_full_disk_on_rank_1, str(tmp_path))
    for kind in ("dcp", "shards"):
        assert r0[kind] == r1[kind], (kind, r0[kind], r1[kind])  # the same error on both ranks
        for verdict in r0[kind]:
            assert verdict.startswith("CheckpointError:"), verdict
            assert "No space left on device" in verdict and "the disk is full: free space" in verdict, verdict
    assert "__1_0.distcp" in r0["dcp"][0] and "shard-rank00001.safetensors" in r0["shards"][0]
    # two failed attempts each, and no staging directory left by either
    assert r0["dcp-left"] == ["step-00000001"], r0["dcp-left"]
    assert r0["shards-left"] == [], r0["shards-left"]


def _fsync_fails_on_rank_1(rank: int, world: int, root: str) -> dict[str, Any]:
    """The files are written, but making them durable fails on rank 1 (an I/O error from fsync,
    reported on the background thread that seals them)."""
    import torch.distributed as dist

    from hp_checkpoint import manifest
    from hp_checkpoint.atomic import save_checkpoint

    save_checkpoint(_state(), root, 1)
    real = manifest.fsync_file

    def broken(path: str) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    if rank == 1:
        manifest.fsync_file = broken
    try:
        out: dict[str, Any] = {"dcp": _try(lambda: save_checkpoint(_state(), root, 2))}
    finally:
        manifest.fsync_file = real
    dist.barrier()
    out["left"] = sorted(os.listdir(root))
    out["retry"] = _try(lambda: save_checkpoint(_state(), root, 2))
    return out


def test_a_file_that_cannot_be_made_durable_fails_the_save_on_every_rank(pool2: RankPool, tmp_path: Any) -> None:
    r0, r1 = pool2.run(_fsync_fails_on_rank_1, str(tmp_path))
    assert r0["dcp"] == r1["dcp"], (r0["dcp"], r1["dcp"])
    assert r0["dcp"].startswith("CheckpointError:") and "rank 1 cannot checksum its files" in r0["dcp"], r0["dcp"]
    assert "Input/output error" in r0["dcp"] and "__1_0.distcp" in r0["dcp"], r0["dcp"]
    assert r0["left"] == ["step-00000001"], r0["left"]  # step 1 kept, no staging directory left
    assert r0["retry"] == r1["retry"] == "saved", (r0["retry"], r1["retry"])
