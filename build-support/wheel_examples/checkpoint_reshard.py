"""Run by check_wheels.sh under torchrun (2 gloo ranks) in a venv holding only hp-checkpoint and
hp-dtensor[torch]: a state dict of DTensors saved in one layout loads into other layouts, in both
formats (DCP and safetensors shards), and equals the saved values exactly; a damaged file is refused."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from hp_checkpoint import CheckpointError, load_checkpoint, load_shards, save_checkpoint, save_shards
from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh


def main(root: str) -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    # uneven on purpose: 7 rows over 2 ranks
    whole = {"w": torch.randn(7, 5, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float32)}
    saved = {"w": distribute_tensor(whole["w"], mesh, [Shard(0)]), "b": distribute_tensor(whole["b"], mesh, [Shard(0)])}
    checked = 0
    for fmt, save, load in (("dcp", save_checkpoint, load_checkpoint), ("shards", save_shards, load_shards)):
        path = save(saved, os.path.join(root, fmt), 1)
        for placement in (Replicate(), Shard(1), Shard(0)):
            target = {k: distribute_tensor(torch.zeros_like(v), mesh, [placement if k == "w" else Replicate()])
                      for k, v in whole.items()}
            load(target, path)
            for k, v in whole.items():
                assert torch.equal(target[k].full_tensor(), v), (fmt, placement, k)
                checked += 1
        dist.barrier()
        if dist.get_rank() == 0:  # damage one data file: every rank must refuse to load
            data = sorted(f for f in os.listdir(path) if f != "manifest.json" and not f.startswith("."))[0]
            with open(os.path.join(path, data), "r+b") as f:
                f.seek(0)
                f.write(b"\x00\x01\x02")
        dist.barrier()
        try:
            load({k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate()]) for k, v in whole.items()}, path)
        except CheckpointError as e:
            assert "sha256" in str(e) or "damaged" in str(e) or "corrupt" in str(e), e
        else:
            raise AssertionError(f"{fmt}: a damaged checkpoint loaded")
    if dist.get_rank() == 0:
        print(f"ok: 2-rank checkpoints reshard on load in both formats ({checked} tensors equal), damage refused")
    # every rank is done with its last collective before any tears its groups down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
