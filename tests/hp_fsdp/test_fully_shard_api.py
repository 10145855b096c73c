# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""fully_shard's controls and its failures, on 2 gloo ranks: explicit unshard/reshard, ignored and
tied parameters, forward without grad, prefetch of the next group, meta-device init with
``to_empty`` and dtype conversion, the CPU offload notice, and every bad call raising the same documented error on every rank before anything changes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from fsdp_models import Net
from torch import nn

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)


def _mesh(world: int) -> Any:
    from hp_dtensor import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def _unshard_reshard(rank: int, world: int) -> dict[str, Any]:
    from hp_dtensor import CommDebugMode, DTensor
    from hp_fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = _mesh(world)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {"isinstance": isinstance(model, FSDPModule) and isinstance(model, Net)}
    out["sharded_shape"] = tuple(model.out.weight.shape), tuple(model.out.weight._local_tensor.shape)
    with CommDebugMode() as comm:
        model.unshard()
    out["unshard_comm"] = dict(comm.get_comm_counts())
    w = model.out.weight  # the root's group: now a plain tensor with the whole weight
    out["unsharded_is_plain"] = not isinstance(w, DTensor)
    out["unsharded_equal"] = bool(torch.equal(w.detach(), ref.out.weight.detach()))
    model.reshard()
    out["resharded_is_dtensor"] = isinstance(model.out.weight, DTensor)
    # forward without grad: every group is resharded afterwards, the output is the reference's
    x = torch.randn(4, 5)
    with torch.no_grad():
        y = model(x)
    out["no_grad_equal"] = bool(torch.allclose(y, ref(x), rtol=1e-5, atol=1e-6))
    out["all_sharded_after_no_grad"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def test_unshard_reshard_and_no_grad_forward(pool2: RankPool) -> None:
    for r in pool2.run(_unshard_reshard):
        assert r["isinstance"]
        assert r["sharded_shape"] == ((3, 10), (2, 10)) or r["sharded_shape"] == ((3, 10), (1, 10)), r
        assert r["unshard_comm"] == {"all_gather": 1}
        assert r["unsharded_is_plain"] and r["unsharded_equal"] and r["resharded_is_dtensor"]
        assert r["no_grad_equal"] and r["all_sharded_after_no_grad"]


def _ignored_and_tied(rank: int, world: int) -> dict[str, Any]:
    from hp_dtensor import DTensor
    from hp_fsdp import fully_shard

    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.mid = nn.Linear(4, 4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight  # one parameter, two modules

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mid(self.emb(ids))))

    ref = Tied()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=_mesh(world), ignored_params={model.mid.bias})
    out = {
        "tied_same": model.head.weight is model.emb.weight,
        "ignored_plain": not isinstance(model.mid.bias, DTensor),
        "n_params": len(list(model.parameters())),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = torch.arange(6).reshape(2, 3) % 7
    for _ in range(2):
        model(ids.chunk(world)[rank]).square().mean().backward()
        # the ignored parameter is not reduced by fully_shard: average it by hand as DDP would
        from hp_dtensor.platform.torch import collectives

        g = model.mid.bias.grad
        model.mid.bias.grad = collectives.all_reduce(g, "avg", _mesh(world).get_group(), world)
        opt.step()
        opt.zero_grad()
        ref(ids).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
    out["emb_err"] = float((model.emb.weight.full_tensor() - ref.emb.weight).abs().max())
    out["bias_err"] = float((model.mid.bias - ref.mid.bias).abs().max())
    return out


def test_ignored_and_tied_parameters(pool2: RankPool) -> None:
    for r in pool2.run(_ignored_and_tied):
        assert r["tied_same"] and r["ignored_plain"] and r["n_params"] == 3, r
        assert r["emb_err"] < 1e-6 and r["bias_err"] < 1e-6, r


def _prefetch(rank: int, world: int) -> list[list[str]]:
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    mesh = _mesh(world)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    states = [b._hp_fsdp_state.group for b in model.blocks]
    seen: list[list[str]] = []
    for _step in range(2):
        marks: list[str] = []
        hooks = [
            b.register_forward_hook(lambda _m, _a, _o, i=i, marks=marks: marks.append(
                f"fwd{i}:next_in_flight={i + 1 < len(states) and states[i + 1]._pending is not None}"))
            for i, b in enumerate(model.blocks)
        ]
        model(torch.randn(4, 5)).sum().backward()
        for h in hooks:
            h.remove()
        seen.append(marks)
    return seen


def test_forward_prefetch_from_the_second_step(pool2: RankPool) -> None:
    for seen in pool2.run(_prefetch):
        first, second = seen
        assert first == ["fwd0:next_in_flight=False", "fwd1:next_in_flight=False", "fwd2:next_in_flight=False"]
        # from the second step on, each block's forward runs while the next block's gather is in flight
        assert second == ["fwd0:next_in_flight=True", "fwd1:next_in_flight=True", "fwd2:next_in_flight=False"]


def _bad(rank: int, world: int, which: str) -> str:
    from hp_dtensor import distribute_tensor, init_device_mesh
    from hp_fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = Net(blocks=1)
    before = {n: p for n, p in model.named_parameters()}
    try:
        if which == "twice":
            fully_shard(model, mesh=_mesh(world))
            fully_shard(model, mesh=_mesh(world))
        elif which == "3d_mesh":
            m3 = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("a", "b", "c"))
            fully_shard(model, mesh=m3)
        elif which == "mesh_not_a_mesh":
            fully_shard(model, mesh="dp")
        elif which == "not_a_module":
            fully_shard(torch.zeros(3), mesh=_mesh(world))
        elif which == "mixed_dtypes":
            model.out.double()
            fully_shard(model, mesh=_mesh(world))
        elif which == "scalar":
            model.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
            before["scale"] = model.scale
            fully_shard(model, mesh=_mesh(world))
        elif which == "reshard_int":
            fully_shard(model, mesh=_mesh(world), reshard_after_forward=3)
        elif which == "tp_overlap":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            model.out.weight = nn.Parameter(distribute_tensor(model.out.weight.detach(), mesh, [
                __import__("hp_dtensor").Shard(0)]))
            before["out.weight"] = model.out.weight
            fully_shard(model, mesh=mesh)
        elif which == "tp_other_root":
            tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            model.out.weight = nn.Parameter(distribute_tensor(model.out.weight.detach(), tp, [
                __import__("hp_dtensor").Replicate()]))
            before["out.weight"] = model.out.weight
            fully_shard(model, mesh=_mesh(world))
        elif which == "offload_on_cpu":
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fully_shard(model, mesh=_mesh(world), offload_policy=CPUOffloadPolicy())
            return "warned: " + "; ".join(str(w.message) for w in caught if "CPUOffloadPolicy" in str(w.message))
        else:
            raise AssertionError(which)
    except (ValueError, TypeError, NotImplementedError) as e:
        if which != "twice":  # a failed call leaves the module as it was
            after = {n: p for n, p in model.named_parameters()}
            assert after.keys() == before.keys() and all(after[n] is before[n] for n in after), which
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "which,expect",
    [
        ("twice", "ValueError: fully_shard was already applied"),
        ("3d_mesh", "ValueError: fully_shard takes a 1-D mesh (FSDP) or a 2-D"),
        ("mesh_not_a_mesh", "TypeError: fully_shard: mesh must be a DeviceMesh, got str"),
        ("not_a_module", "TypeError: fully_shard takes a module, got Tensor"),
        ("mixed_dtypes", "ValueError: fully_shard gathers a group's parameters in one buffer"),
        ("scalar", "ValueError: fully_shard shards dim 0 of every parameter, but 'scale' is a scalar"),
        ("reshard_int", "ValueError: reshard_after_forward=3: an int is the size of the groups"),
        ("tp_overlap", "ValueError: fully_shard: parameter 'out.weight' is already split over mesh dim(s) ['dp']"),
        ("tp_other_root", "ValueError: fully_shard: parameter 'out.weight' is a DTensor on"),
        ("offload_on_cpu", "warned: CPUOffloadPolicy: the parameters already live in host memory"),
    ],
)
def test_bad_calls_fail_the_same_way_on_every_rank(pool2: RankPool, which: str, expect: str) -> None:
    results = pool2.run(_bad, which)
    assert all(r.startswith(expect) for r in results), results
    assert len(set(results)) == 1, results


def _meta_init(rank: int, world: int) -> dict[str, Any]:
    from hp_dtensor import distribute_tensor
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    ref = Net()
    with torch.device("meta"):
        model = Net()
    mesh = _mesh(world)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # torchtitan's flow: shard on meta, then materialize shards only
    with torch.no_grad():
        for p, rp in zip(model.parameters(), ref.parameters()):
            p.to_local().copy_(distribute_tensor(rp.detach(), p.device_mesh, p.placements).to_local())
    model.double()
    ref.double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(4, 5, dtype=torch.float64, generator=gen)
        model(x.chunk(world)[rank]).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    return {
        "devices": {str(p.to_local().device) for p in model.parameters()},
        "dtypes": {str(p.dtype) for p in model.parameters()},
        "err": max(float((p.full_tensor() - rp).abs().max()) for p, rp in zip(model.parameters(), ref.parameters())),
    }


def test_meta_device_init_then_to_empty_and_dtype_conversion(pool2: RankPool) -> None:
    for r in pool2.run(_meta_init):
        assert r["devices"] == {"cpu"} and r["dtypes"] == {"torch.float64"}, r
        assert r["err"] < 1e-12, r
