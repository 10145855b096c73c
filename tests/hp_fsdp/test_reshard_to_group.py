# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
"""``reshard_after_forward=<int>`` on 4 gloo ranks, against torch's ``fully_shard`` with the same
int on the same model, weights and data, and against one process.

With ``k = 2``, each block's parameters are resharded after forward to groups of 2 consecutive
ranks ({0, 1} and {2, 3}): between forward and backward each rank holds half of the block's
gathered buffer (``full / k``, torch's share too), and backward gathers it back over its group of
2 instead of all 4.  Pinned per step and phase: every collective's kind, the ranks it ran over and
its bytes (equal to torch's, the same observer counting both), every gradient and parameter shard
equal to torch's after each of 3 AdamW steps, and the parameters within fp32 tolerance of one
process.  ``k = 1`` and ``k = 4`` behave as torch's do (False with a warning; True); ints that do
not divide the shard group, below 1, non-ints and an int given to ``set_reshard_after_forward``
raise the same exception type as torch's, with one message on every rank.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from comm_groups import GroupLog, local, max_diff, torch_counts
from fsdp_models import ATOL, RTOL, Net

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=240)
BLOCKS = 3


def _padded_bytes(module: torch.nn.Module, n: int) -> int:
    """Bytes of one gathered copy of ``module``'s own parameters, dim 0 padded to a multiple of n."""
    total = 0
    for p in module.parameters(recurse=False):
        total += math.ceil(p.shape[0] / n) * n * (p.numel() // p.shape[0]) * p.element_size()
    for child in module.children():
        total += _padded_bytes(child, n)
    return total


def _ours_held(block: Any) -> int:
    """Bytes of gathered parameter data this block's group holds now (its part after forward and
    any unsharded storage still allocated)."""
    group = block._hp_fsdp_state.group
    held = 0
    if group._post_forward is not None:
        part = group._post_forward[1]
        held += part.numel() * part.element_size()
    for p in group.params:
        if p.unsharded_local is not None:
            held += p.unsharded_local.untyped_storage().nbytes()
    return held


def _torch_held(block: Any) -> int:
    held = 0
    for group in block._get_fsdp_state()._fsdp_param_groups:
        for fp in group.fsdp_params:
            data = getattr(fp, "_sharded_post_forward_param_data", None)
            if data is not None:
                held += data.numel() * data.element_size()
            for t in getattr(fp, "all_gather_outputs", []):
                held += t.untyped_storage().nbytes()
    return held


def _compare(rank: int, world: int, k: int | bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchComm

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    ref = Net(blocks=BLOCKS)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tmesh = torch_mesh("cpu", (world,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in ours.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=k)
    warned = sorted({str(w.message) for w in caught if "reshard_after_forward" in str(w.message)})
    fully_shard(ours, mesh=mesh)  # the root: None, kept gathered for backward
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=tmesh, reshard_after_forward=k)
    torch_fully_shard(theirs, mesh=tmesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    gen = torch.Generator().manual_seed(7)
    steps: list[dict[str, Any]] = []
    worst_torch = worst_ref = 0.0
    for _step in range(3):
        x = torch.randn(8, 5, generator=gen)
        seen: dict[str, Any] = {}
        for who, model, mode, count, held in (
            ("ours", ours, CommDebugMode, lambda c: c.get_comm_counts(), _ours_held),
            ("torch", theirs, TorchComm, torch_counts, _torch_held),
        ):
            with mode() as comm, GroupLog() as log:
                y = model(x.chunk(world)[rank])
            seen[f"{who} forward"] = (sorted(log.log), count(comm))
            seen[f"{who} held"] = [held(b) for b in model.blocks]
            with mode() as comm, GroupLog() as log:
                y.square().mean().backward()
            seen[f"{who} backward"] = (sorted(log.log), count(comm))
        ref(x).square().mean().backward()
        steps.append(seen)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            worst_torch = max(worst_torch, max_diff(local(p.grad), local(q.grad)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for p, q, r in zip(ours.parameters(), theirs.parameters(), ref.parameters()):
                worst_torch = max(worst_torch, max_diff(local(p), local(q)))
                full = p.full_tensor()
                worst_ref = max(worst_ref, float(((full - r).abs() / (ATOL + RTOL * r.abs())).max()))
    return {
        "steps": steps, "worst_torch": worst_torch, "worst_ref": worst_ref, "warned": warned,
        "block_bytes": [_padded_bytes(b, world) for b in ref.blocks],
        "block_exact": [sum(p.numel() * p.element_size() for p in b.parameters()) for b in ref.blocks],
        "root_bytes": _padded_bytes(ref, world) - sum(_padded_bytes(b, world) for b in ref.blocks),
    }


def _expected(rank: int, k: int | bool, block_bytes: list[int], root_bytes: int) -> dict[str, list[Any]]:
    """(kind, ranks, bytes) of one step's collectives, sorted, per phase."""
    world = (0, 1, 2, 3)
    small = (0, 1) if rank < 2 else (2, 3)
    forward = sorted([("all_gather", world, root_bytes)] + [("all_gather", world, b) for b in block_bytes])
    # k == 1: kept gathered, like False (no dict here: True == 1 as a key)
    regather = None if k == 1 and k is not True else small if k == 2 else world
    backward = [("reduce_scatter", world, root_bytes)] + [("reduce_scatter", world, b) for b in block_bytes]
    if regather is not None:
        backward += [("all_gather", regather, b) for b in block_bytes]
    return {"forward": forward, "backward": sorted(backward)}


def _kinds(log: list[Any]) -> dict[str, int]:
    return dict(Counter(kind for kind, _, _ in log))


@pytest.mark.parametrize("k", [2, 1, 4, True])
def test_reshard_to_a_smaller_group_equals_torch_and_one_process(pool4: RankPool, k: int | bool) -> None:
    results = pool4.run(_compare, k)
    for rank, r in enumerate(results):
        assert r["worst_torch"] <= 1e-6, r["worst_torch"]
        assert r["worst_ref"] <= 1.0, r["worst_ref"]
        want = _expected(rank, k, r["block_bytes"], r["root_bytes"])
        # what each rank holds of a block between forward and backward: full / k (nothing at k = 4)
        kept_whole = k == 1 and k is not True  # True == 1: a bool is not the int 1
        if k is True or k == 4:
            held = torch_held = [0] * BLOCKS
        elif kept_whole:
            # kept gathered, as False: ours holds the parameters themselves, torch its padded buffers
            held, torch_held = r["block_exact"], r["block_bytes"]
        else:
            held = torch_held = [b // k for b in r["block_bytes"]]
        for step in r["steps"]:
            for phase in ("forward", "backward"):
                ours, ours_own = step[f"ours {phase}"]
                theirs, theirs_own = step[f"torch {phase}"]
                assert ours == want[phase], (rank, phase, ours, want[phase])
                assert theirs == want[phase], (rank, phase, theirs, want[phase])
                # each library's own CommDebugMode saw exactly what the observer saw
                assert ours_own == _kinds(ours) and theirs_own == _kinds(theirs), (ours_own, theirs_own)
            assert step["ours held"] == held and step["torch held"] == torch_held, (step["ours held"], step["torch held"])
        if kept_whole:
            assert r["warned"] and "reshard_after_forward=1 (int)" in r["warned"][0], r["warned"]
        else:
            assert not r["warned"], r["warned"]
    print(f"reshard_after_forward={k!r}: 3 steps x 2 phases, every collective's ranks and bytes equal "
          f"torch's; held between forward and backward per block {results[0]['steps'][0]['ours held']} "
          f"of {results[0]['block_bytes']} bytes; worst |ours - torch| "
          f"{max(r['worst_torch'] for r in results):.1e}")


def _bad(rank: int, world: int, which: str, value: Any) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from hp_dtensor import init_device_mesh
    from hp_fsdp import fully_shard

    out = []
    for shard, mesh in ((fully_shard, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))),
                        (torch_fully_shard, torch_mesh("cpu", (world,)))):
        torch.manual_seed(0)
        model = Net(blocks=1)
        try:
            if which == "fully_shard":
                shard(model, mesh=mesh, reshard_after_forward=value)
            else:
                shard(model, mesh=mesh).set_reshard_after_forward(value)
            out.append("no error")
        except Exception as e:  # noqa: BLE001 -- the exception type is what is compared
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.parametrize(
    "which,value",
    [("fully_shard", 3), ("fully_shard", 0), ("fully_shard", -2), ("fully_shard", 8), ("fully_shard", 2.0),
     ("fully_shard", "2"), ("set_reshard_after_forward", 2), ("set_reshard_after_forward", 1)],
)
def test_bad_group_sizes_fail_like_torch_on_every_rank(pool4: RankPool, which: str, value: Any) -> None:
    results = pool4.run(_bad, which, value)
    ours = {r[0] for r in results}
    theirs = {r[1].split(":")[0] for r in results}
    assert len(ours) == 1, ours
    (msg,) = ours
    assert msg.startswith("ValueError: ") and theirs == {"ValueError"}, (msg, theirs)
    assert repr(value) in msg or str(value) in msg, msg
