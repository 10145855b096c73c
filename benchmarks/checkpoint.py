"""The trainer's checkpoint, save and load, 2 gloo ranks, tp=2 Qwen3.5 with AdamW state, same run:
its default path (``new``: atomic ``safetensors-shards``, each rank writes one safetensors file of
its own boxes, checksums, manifest, rename; load verifies every checksum first) and its DCP path
(``atomic``: the same commit over ``torch.distributed.checkpoint``'s files, the default under
pipeline parallelism) against the old path (full weights gathered to rank 0 and written as HF
safetensors, optimizer state as one ``torch.save`` file per rank; load reads the HF file's slices
and each rank's optimizer file), and against plain ``torch.distributed.checkpoint`` (``dcp.save``
/ ``dcp.load`` of the same state dict, no checksums, no manifest, no rename: the format's own
speed, the anchor users compare with).  The trainer's paths keep one step (``keep=1``), as a
long run does: each save also prunes the one before.

Printed per model size: seconds per GB-equivalent of state (model + AdamW moments, global fp32
bytes), median of repeated saves/loads interleaved so machine noise hits both alike, and the
ratio old / new (above 1: the new path is faster).  Both paths' loads are checked to restore the
same parameters.

Run: ./pants run benchmarks/checkpoint.py   (or python benchmarks/checkpoint.py)
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from hp_dtensor.testing import RankPool

REPEATS = 7
PATHS = ("new", "atomic", "old", "dcp")  # the trainer's default, its DCP path, the old path, plain DCP
SIZES = {"tiny (4 layers, vocab 1k)": {}, "wider (8 layers, vocab 16k)": {"num_hidden_layers": 8, "vocab_size": 16384}}


def _build(overrides: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import init_device_mesh
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp, tiny_config

    config = tiny_config(**overrides)
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    parallelize_qwen3_5_tp(model, init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    from hp_tp import loss_parallel

    with loss_parallel():
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    opt.zero_grad()
    return config, model, opt


def _old_save(adapter: Any, model: Any, opt: Any, path: str, rank: int) -> None:
    """The trainer's former checkpoint: HF file gathered on rank 0 + per-rank optimizer files."""
    import torch
    import torch.distributed as dist

    adapter.save(model, path)
    state = {}
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = opt.state.get(p, {})
            state[f"{i}.{j}"] = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()}
    os.makedirs(path, exist_ok=True)
    torch.save(state, os.path.join(path, f"optimizer-rank{rank}.pt"))
    dist.barrier()


def _old_load(adapter: Any, model: Any, opt: Any, path: str, rank: int) -> None:
    import torch

    from hp_dtensor import DTensor

    adapter.load_into(model, path)
    saved = torch.load(os.path.join(path, f"optimizer-rank{rank}.pt"))
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = saved.get(f"{i}.{j}", {})
            opt.state[p] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=tuple(p.shape))
                if hasattr(p, "placements") and v.ndim > 0 else v
                for k, v in st.items()
            }


def _plain_load(dcp: Any, state_of: Any, model: Any, opt: Any, path: str) -> None:
    """Plain ``dcp.load`` into the trainer's state dict (its model entries are the parameters
    themselves), then the optimizer state back into the optimizer, as the trainer's load does."""
    from hp_checkpoint.dcp import set_optimizer_state_dict

    state = state_of(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    # Start from a clean page cache: the paths that do not fsync leave dirty pages behind, and
    # the next fsync (ext4 commits its journal in order) would pay for their writeback.
    os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _bench(rank: int, world: int, overrides: dict[str, Any], folder: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hp_checkpoint.manifest import CheckpointKind
    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter
    from hp_models.train_checkpoint import _state, load_train_state, save_train_state

    config, model, opt = _build(overrides)
    adapter = Qwen3_5StateDictAdapter(config)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + 2 moments
    times: dict[str, list[float]] = {f"{path} {op}": [] for op in ("save", "load") for path in PATHS}
    trainer = {"new": (os.path.join(folder, "new"), CheckpointKind.SAFETENSORS_SHARDS),
               "atomic": (os.path.join(folder, "atomic"), CheckpointKind.DCP)}
    old = os.path.join(folder, "old")
    plain = os.path.join(folder, "dcp")
    want = {n: p.full_tensor().clone() for n, p in model.named_parameters()}

    def restored(load: Any) -> float:
        """Time ``load`` into zeroed parameters, and check it restored every one."""
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        took = _timed(load)
        bad = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), want[n])]
        assert not bad, f"a load did not restore {bad[:3]}"
        return took

    # one untimed round first: a process's first writes into fresh page-cache memory run several
    # times slower on this VM, and would fall on whichever path happens to go first
    for r in range(REPEATS + 1):
        if r == 1:
            for samples in times.values():
                samples.clear()
        for path, (root, fmt) in trainer.items():
            times[f"{path} save"].append(_timed(lambda step=r + 1, root=root, fmt=fmt: save_train_state(
                root, model, opt, step, [1.0], seed=0, keep=1, layout={"tp": 2}, fmt=fmt)))
        times["old save"].append(_timed(lambda: _old_save(adapter, model, opt, old, rank)))
        plain_r = f"{plain}-{r}"  # a fresh directory each repeat: dcp.save warns when it overwrites
        times["dcp save"].append(_timed(lambda path=plain_r: dcp.save(_state(model, opt), checkpoint_id=path)))
        for path, (root, _) in trainer.items():
            times[f"{path} load"].append(restored(lambda root=root: load_train_state(root, model, opt, seed=0,
                                                                                      announce=False)))
        times["old load"].append(restored(lambda: _old_load(adapter, model, opt, old, rank)))
        times["dcp load"].append(restored(lambda path=plain_r: _plain_load(dcp, _state, model, opt, path)))
        if rank == 0:
            shutil.rmtree(plain_r, ignore_errors=True)
    dist.barrier()
    return {"bytes": nbytes, "times": times}


def main() -> None:
    cores = os.cpu_count()
    print(f"checkpoint save/load, 2 gloo ranks (tp=2), {cores} cores, median of {REPEATS}; s/GB = seconds per GB "
          f"of model + AdamW state")
    heads = " ".join(f"{h:>6s}" for h in PATHS[1:])
    print(f"{'model':28s} {'GB':>6s} {'new save':>9s} {heads} {'old/new':>7s} {'dcp/new':>7s} "
          f"{'new load':>9s} {heads} {'old/new':>7s} {'dcp/new':>7s}")
    with RankPool(2, timeout=1200) as pool:
        for name, overrides in SIZES.items():
            folder = tempfile.mkdtemp(prefix="hp-ckpt-bench-")
            try:
                r0 = pool.run(_bench, overrides, folder)[0]
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            gb = r0["bytes"] / 1e9
            med = {k: statistics.median(v) / gb for k, v in r0["times"].items()}
            cols = []
            for op in ("save", "load"):
                new, *rest = (med[f"{path} {op}"] for path in PATHS)
                others = " ".join(f"{v:6.2f}" for v in rest)
                cols.append(f"{new:9.2f} {others} {med[f'old {op}'] / new:6.2f}x {med[f'dcp {op}'] / new:6.2f}x")
            print(f"{name:28s} {gb:6.3f} {' '.join(cols)}")
    print("new = the trainer's default (safetensors-shards), atomic = its DCP path (pipeline parallelism). Ratios "
          "above 1: new is faster. Unlike old and plain dcp, new and atomic fsync and checksum every file and "
          "commit by rename, and their loads verify every checksum before reading.")


if __name__ == "__main__":
    main()
