# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""DTensors through ``torch.distributed.checkpoint`` on 4 gloo ranks.

Seeded generated cases: random tensors (1-3 dims, sizes 1-13, several dtypes) saved under one
random layout on a (4,) or (2, 2) mesh (uneven splits, two shardings of one dim, empty shards) and
loaded under another; the loaded shard must equal, bit for bit, the nested ``torch.chunk`` slice of
the original tensor.  The saved metadata must hold each distinct non-empty shard exactly once,
written by a rank that holds it.  torch's own reader (``dcp_to_torch_save``) reads the checkpoint
into plain tensors on one process.  Bad loads raise ``CheckpointError`` on every rank, naming the
tensor."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)

MESHES = ((4,), (2, 2))
DTYPES = ("float32", "float64", "bfloat16", "int64")
CHECKPOINTS = 24  # each holds TENSORS generated tensors
TENSORS = 6


def _layout(rng: random.Random, ndim: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A random mesh and placements: each mesh dim replicates or shards a random tensor dim."""
    mesh = rng.choice(MESHES)
    pl = tuple("R" if rng.random() < 0.3 else f"S{rng.randrange(ndim)}" for _ in mesh)
    return mesh, pl


def make_cases(seed: int) -> list[dict[str, Any]]:
    """The generated checkpoints: each a list of tensor specs with a save and a load layout."""
    rng = random.Random(seed)
    out = []
    for c in range(CHECKPOINTS):
        tensors = []
        for t in range(TENSORS):
            ndim = rng.randint(1, 3)
            shape = tuple(rng.randint(1, 13) for _ in range(ndim))
            tensors.append({
                "key": f"block{c % 3}.t{t}", "shape": shape, "dtype": rng.choice(DTYPES),
                "save": _layout(rng, ndim), "load": _layout(rng, ndim), "seed": rng.randrange(2**31),
            })
        out.append({"tensors": tensors, "torch_api": c % 2 == 1})
    return out


def _value(spec: dict[str, Any]) -> Any:
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(spec["shape"], generator=g, dtype=torch.float64)
    if spec["dtype"] == "int64":
        return (x * 1000).to(torch.int64)
    return x.to(getattr(torch, spec["dtype"]))


def _placements(pl: tuple[str, ...]) -> list[Any]:
    from hp_dtensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in pl]


def _chunk_ref(x: Any, mesh_shape: tuple[int, ...], pl: tuple[str, ...], coord: tuple[int, ...]) -> Any:
    """The shard at ``coord`` by torch's rule: each mesh dim in order ``torch.chunk``s what the
    earlier ones left; a rank past the last chunk gets an empty slice."""
    for k, p in enumerate(pl):
        if p == "R":
            continue
        d = int(p[1:])
        chunks = x.chunk(mesh_shape[k], d)
        if coord[k] < len(chunks):
            x = chunks[coord[k]]
        else:
            x = x.narrow(d, x.shape[d], 0)
    return x


def _boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], pl: tuple[str, ...]) -> dict[tuple, set[int]]:
    """Distinct non-empty boxes (offsets, sizes) of a layout -> the ranks holding each, computed
    with ``torch.chunk`` on an index tensor (independent of the code under test)."""
    import itertools

    import torch

    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n).reshape(shape)
    out: dict[tuple, set[int]] = {}
    for rank, coord in enumerate(itertools.product(*[range(m) for m in mesh_shape])):
        piece = _chunk_ref(idx, mesh_shape, pl, coord)
        if piece.numel() == 0:
            continue
        first = int(piece.reshape(-1)[0])
        offsets = tuple(int(v) for v in torch.unravel_index(torch.tensor(first), shape))
        out.setdefault((offsets, tuple(piece.shape)), set()).add(rank)
    return out


def _roundtrip(rank: int, world: int, root: str, seed: int) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from hp_checkpoint.dcp import load, save
    from hp_dtensor import DTensor, distribute_tensor, init_device_mesh

    meshes = {shape: init_device_mesh("cpu", shape) for shape in MESHES}
    cases = make_cases(seed)
    tensors = mismatches = empty_shards = nested = 0
    for c, case in enumerate(cases):
        path = os.path.join(root, f"ckpt{c}")
        saved = {}
        for t in case["tensors"]:
            mesh_shape, pl = t["save"]
            saved[t["key"]] = distribute_tensor(_value(t), meshes[mesh_shape], _placements(pl), src_data_rank=None)
        if case["torch_api"]:
            dcp.save({"m": saved}, checkpoint_id=path)
        else:
            save({"m": saved}, path)
        target = {}
        for t in case["tensors"]:
            mesh_shape, pl = t["load"]
            blank = torch.full(t["shape"], -7).to(getattr(torch, t["dtype"]))
            target[t["key"]] = distribute_tensor(blank, meshes[mesh_shape], _placements(pl), src_data_rank=None)
        loaded_ref = dict(target)
        if case["torch_api"]:
            dcp.load({"m": target}, checkpoint_id=path)
        else:
            load({"m": target}, path)
        for t in case["tensors"]:
            got = target[t["key"]]
            assert got is loaded_ref[t["key"]], "load must fill the given DTensor in place"
            mesh_shape, pl = t["load"]
            mesh = meshes[mesh_shape]
            coord = tuple(mesh.get_coordinate())
            want = _chunk_ref(_value(t), mesh_shape, pl, coord)
            local = got._local_tensor
            ok = local.shape == want.shape and torch.equal(local, want) and isinstance(got, DTensor)
            ok = ok and torch.equal(got.full_tensor(), _value(t))
            tensors += 1
            mismatches += 0 if ok else 1
            empty_shards += int(local.numel() == 0)
            nested += int(len(set(p for p in pl if p != "R")) < sum(p != "R" for p in pl))
    return {"tensors": tensors, "mismatches": mismatches, "empty_shards": empty_shards, "nested": nested}


def _check_metadata(root: str, seed: int) -> tuple[int, int]:
    """Every saved tensor: the checkpoint's chunks are exactly the distinct non-empty boxes of its
    save layout, each stored in the file of a rank that holds it.  Returns (tensors, chunks)."""
    from torch.distributed.checkpoint import FileSystemReader

    n_tensors = n_chunks = 0
    for c, case in enumerate(make_cases(seed)):
        reader = FileSystemReader(os.path.join(root, f"ckpt{c}"))
        md = reader.read_metadata()
        for t in case["tensors"]:
            fqn = f"m.{t['key']}"
            tmd = md.state_dict_metadata[fqn]
            want = _boxes(t["shape"], *t["save"])
            got = [(tuple(ch.offsets), tuple(ch.sizes)) for ch in tmd.chunks]
            assert sorted(got) == sorted(want), (fqn, t, got, want)
            for index, info in md.storage_data.items():
                if index.fqn != fqn:
                    continue
                writer = int(info.relative_path.split("_")[2])  # __{rank}_{n}.distcp
                box = next(b for b in want if b[0] == tuple(index.offset))
                assert writer in want[box], (fqn, box, writer, want[box])
            n_tensors += 1
            n_chunks += len(got)
    return n_tensors, n_chunks


def _interop(root: str, seed: int) -> int:
    """torch's one-process converter reads our checkpoints into plain tensors, values equal."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checked = 0
    for c, case in enumerate(make_cases(seed)):
        out = os.path.join(root, f"ckpt{c}.pt")
        dcp_to_torch_save(os.path.join(root, f"ckpt{c}"), out)
        plain = torch.load(out, weights_only=True)
        for t in case["tensors"]:
            v = plain["m"][t["key"]]
            assert type(v) is torch.Tensor and torch.equal(v, _value(t)), t
            checked += 1
    return checked


@pytest.mark.parametrize("seed", [0, 1])
def test_generated_layouts_roundtrip_bit_exact(pool4: RankPool, tmp_path: Any, seed: int, capsys: Any) -> None:
    results = pool4.run(_roundtrip, str(tmp_path), seed)
    total = sum(r["tensors"] for r in results)
    bad = sum(r["mismatches"] for r in results)
    n_tensors, n_chunks = _check_metadata(str(tmp_path), seed)
    checked = _interop(str(tmp_path), seed)
    with capsys.disabled():  # the size of the proof shows in every run
        print(
            f"\ncheckpoint layouts, seed {seed}: {CHECKPOINTS} checkpoints, {n_tensors} tensors saved as "
            f"{n_chunks} chunks; {total} (tensor, rank) loads, {bad} mismatches, "
            f"{sum(r['empty_shards'] for r in results)} empty target shards, "
            f"{sum(r['nested'] for r in results)} nested-shard targets; {checked} read back by dcp_to_torch_save"
        )
    assert total == 4 * CHECKPOINTS * TENSORS and bad == 0
    assert n_tensors == CHECKPOINTS * TENSORS == checked
    assert sum(r["empty_shards"] for r in results) > 0 and sum(r["nested"] for r in results) > 0


def _attempt(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("no error", "")
    except Exception as e:
        return (type(e).__name__, str(e))


def _bad_load(rank: int, world: int, root: str) -> dict[str, tuple[str, str]]:
    import torch

    from hp_checkpoint.dcp import load, save
    from hp_dtensor import Partial, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    path = os.path.join(root, "bad")
    w = distribute_tensor(torch.arange(30.0).reshape(5, 6), mesh, [Shard(0)], src_data_rank=None)
    save({"layer.weight": w, "step": 3}, path)

    def fresh(shape=(5, 6), dtype=torch.float32) -> Any:
        return distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(len(shape) - 1)], src_data_rank=None)

    partial = distribute_tensor(torch.ones(5, 6), mesh, [Partial()], src_data_rank=None)
    out = {
        "wrong_shape": _attempt(lambda: load({"layer.weight": fresh((6, 5))}, path)),
        "wrong_dtype": _attempt(lambda: load({"layer.weight": fresh(dtype=torch.float64)}, path)),
        "missing_key": _attempt(lambda: load({"layer.weight": fresh(), "layer.bias": fresh((6,))}, path)),
        "tensor_for_object": _attempt(lambda: load({"step": torch.zeros(())}, path)),
        "partial_save": _attempt(lambda: save({"layer.acc": partial}, os.path.join(root, "partial"))),
        "partial_load": _attempt(lambda: load({"layer.weight": partial}, path)),
        # each rank plans its own reads: a target wrong on rank 2 alone still fails on every rank
        "one_rank_wrong": _attempt(lambda: load({"layer.weight": fresh((6, 5)) if rank == 2 else fresh()}, path)),
    }
    # a non-strict load of what exists still works after the failures
    ok = fresh()
    load({"layer.weight": ok, "layer.bias": fresh((6,))}, path, strict=False)
    out["after"] = ("ok" if torch.equal(ok.full_tensor(), torch.arange(30.0).reshape(5, 6)) else "wrong", "")
    return out


def test_bad_loads_fail_on_every_rank_naming_the_tensor(pool4: RankPool, tmp_path: Any) -> None:
    results = pool4.run(_bad_load, str(tmp_path))
    expect = {
        "wrong_shape": ("layer.weight", "(6, 5)"),
        "wrong_dtype": ("layer.weight", "torch.float64"),
        "missing_key": ("layer.bias", "strict=False"),
        "tensor_for_object": ("step", "Python object"),
        "partial_save": ("layer.acc", "Partial"),
        "partial_load": ("layer.weight", "Partial"),
        "one_rank_wrong": ("rank 2", "layer.weight", "(6, 5)"),
    }
    for case, words in expect.items():
        for rank, r in enumerate(results):
            kind, msg = r[case]
            assert kind == "CheckpointError", (case, rank, kind, msg)
            assert all(w in msg for w in words), (case, rank, msg)
        assert len({r[case] for r in results}) == 1, (case, [r[case] for r in results])
    assert all(r["after"][0] == "ok" for r in results)


def _odd_inputs(rank: int, world: int, root: str) -> dict[str, bool]:
    """Non-contiguous shards (a transposed DTensor), a 0-dim DTensor, an empty tensor and a
    tensor inside a list survive a save and a load into other layouts."""
    import torch

    from hp_checkpoint.dcp import load, save
    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    base = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    t = distribute_tensor(base, mesh, [Shard(0)], src_data_rank=None).t()  # (5, 7), Shard(1), a view
    scalar = distribute_tensor(torch.tensor(3.25), mesh, [Replicate()], src_data_rank=None)
    empty = distribute_tensor(torch.zeros(0, 5), mesh2, [Shard(1), Shard(1)], src_data_rank=None)
    path = os.path.join(root, "odd")
    save({"t": t, "s": scalar, "e": empty, "l": [distribute_tensor(base, mesh, [Shard(1)], src_data_rank=None)]}, path)
    t2 = distribute_tensor(torch.zeros(7, 5), mesh2, [Shard(1), Shard(0)], src_data_rank=None).t()
    s2 = distribute_tensor(torch.tensor(0.0), mesh2, [Replicate(), Replicate()], src_data_rank=None)
    e2 = distribute_tensor(torch.ones(0, 5), mesh, [Shard(0)], src_data_rank=None)
    l2 = distribute_tensor(torch.zeros(7, 5), mesh2, [Shard(0), Shard(0)], src_data_rank=None)
    target = {"t": t2, "s": s2, "e": e2, "l": [l2]}
    load(target, path)
    return {
        "transposed_view": not t._local_tensor.is_contiguous() and torch.equal(t2.full_tensor(), base.t()),
        "scalar": float(s2.full_tensor()) == 3.25,
        "empty": tuple(e2.shape) == (0, 5),
        "in_list": torch.equal(target["l"][0].full_tensor(), base),
    }


def test_odd_inputs_roundtrip(pool4: RankPool, tmp_path: Any) -> None:
    results = pool4.run(_odd_inputs, str(tmp_path))
    for r in results:
        assert all(r.values()), r
