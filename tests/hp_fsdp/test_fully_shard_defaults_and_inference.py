# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""``fully_shard`` as outsiders call it, on 2 gloo ranks: without ``mesh=`` it shards over a 1-D
mesh of the whole world, as torch's ``fully_shard`` does -- the same shards, gradients and
parameters as torch's default after 3 AdamW steps, and the same collectives; and a sharded model
run under ``torch.inference_mode()`` equals ``no_grad`` and one process, then still trains."""

from __future__ import annotations

import copy
from typing import Any

import torch
from fsdp_models import Net

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)

_KIND = {"c10d._allgather_base_": "all_gather", "c10d._reduce_scatter_base_": "reduce_scatter",
         "c10d.allreduce_": "all_reduce"}


def _default_mesh_vs_torch(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchComm

    from hp_dtensor import CommDebugMode
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    base = Net()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for b in ours.blocks:
        fully_shard(b)
    fully_shard(ours)
    for b in theirs.blocks:
        torch_fully_shard(b)
    torch_fully_shard(theirs)
    meshes = {(p.device_mesh.device_type, p.device_mesh.shape, tuple(p.placements)) for p in ours.parameters()}
    torch_meshes = {(p.device_mesh.device_type, tuple(p.device_mesh.shape), tuple(map(repr, p.placements)))
                    for p in theirs.parameters()}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(7)
    worst = 0.0
    counts = []
    for _step in range(3):
        x = torch.randn(8, 5, generator=gen).chunk(world)[rank]
        seen = []
        for model, mode in ((ours, CommDebugMode), (theirs, TorchComm)):
            with mode() as comm:
                model(x).square().mean().backward()
            seen.append({_KIND.get(str(k), str(k)): v for k, v in comm.get_comm_counts().items()})
        counts.append(seen)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            worst = max(worst, float((p.grad._local_tensor - q.grad._local_tensor).abs().max()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert p._local_tensor.shape == q._local_tensor.shape
            worst = max(worst, float((p._local_tensor - q._local_tensor).abs().max()))
    return {"meshes": meshes, "torch_meshes": torch_meshes, "worst": worst, "counts": counts}


def test_no_mesh_shards_over_the_whole_world_like_torch(pool2: RankPool) -> None:
    from hp_dtensor import Shard

    results = pool2.run(_default_mesh_vs_torch)
    for r in results:
        assert r["meshes"] == {("cpu", (2,), (Shard(0),))}, r["meshes"]
        assert r["torch_meshes"] == {("cpu", (2,), ("Shard(dim=0)",))}, r["torch_meshes"]
        assert r["worst"] <= 1e-6, r["worst"]
        for ours, theirs in r["counts"]:
            assert ours == theirs, r["counts"]
    print(f"3 AdamW steps on the default mesh: worst |ours - torch| {max(r['worst'] for r in results):.1e}")


def _inference_mode(rank: int, world: int) -> dict[str, Any]:
    from hp_dtensor import init_device_mesh
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    ref = Net().double()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for _ in range(2):
        x = torch.randn(8, 5, dtype=torch.float64, generator=gen)
        xl = x.chunk(world)[rank]
        # inference mode first: its first forward allocates the unsharded parameters
        with torch.inference_mode():
            inf = model(xl.clone())  # an inference-tensor input
            inf_normal = model(xl)
        with torch.no_grad():
            want = ref(x).chunk(world)[rank]
            ng = model(xl)
        for got in (ng, inf, inf_normal):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            checked += 1
        torch.testing.assert_close(inf, ng, rtol=0, atol=0)
    # training after inference: the unsharded parameters inference mode gathered are normal tensors
    opt, ropt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randn(8, 5, dtype=torch.float64, generator=gen)
        model(x.chunk(world)[rank]).square().mean().backward()
        ref(x).square().mean().backward()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-10, atol=1e-12)
        checked += 1
    return {"checked": checked}


def test_sharded_model_under_inference_mode_equals_no_grad_and_one_process(pool2: RankPool) -> None:
    results = pool2.run(_inference_mode)
    print(f"{sum(r['checked'] for r in results)} comparisons against one process")
