# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment,dict-item"
"""The safetensors-shards checkpoint as a careless user drives it, on 2 gloo ranks: model and
AdamW state (nested, name-keyed) saved under one layout and loaded under another bit-equal, with
the param groups' numbers restored; plain tensors that differ between ranks are refused naming
them; transposed DTensor views, ``/`` in names, NaN and infinities round-trip bit-exact; a
non-tensor leaf, ``|`` in a name, a root that is a file, a negative step, a different dtype and
missing keys are each refused with a message naming the value, on every rank."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=240)


def _step(model: Any, opt: Any, s: int, layout: str) -> None:
    """One AdamW step on step ``s``'s seeded gradients (the same global numbers under any layout)."""
    import torch

    from hp_dtensor import distribute_tensor

    gs = torch.Generator().manual_seed(100 + s)
    for _, p in model.named_parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gs), p.device_mesh, p.placements)
    opt.step()


def _adamw_state(rank: int, world: int, layout: str, steps: int) -> tuple[Any, Any, dict[str, Any]]:
    """A two-parameter model of DTensors (``layout`` picks the placements) and its AdamW after
    ``steps`` steps on seeded gradients (the same global numbers under any layout)."""
    import torch

    from hp_checkpoint.dcp import get_model_state_dict, get_optimizer_state_dict
    from hp_dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    places = {"a": {"w": [Shard(0)], "v": [Shard(1)]}, "b": {"w": [Shard(1)], "v": [Replicate()]}}[layout]
    g = torch.Generator().manual_seed(3)
    full = {"w": torch.randn(7, 5, generator=g), "v": torch.randn(4, 9, generator=g)}
    model = torch.nn.Module()
    for k, v in full.items():
        model.register_parameter(k, torch.nn.Parameter(distribute_tensor(v, mesh, places[k])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 if layout == "a" else 7.0, weight_decay=0.1, foreach=False)
    for s in range(steps):
        _step(model, opt, s, layout)
    return model, opt, {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optimizer_round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch

    from hp_checkpoint.dcp import set_optimizer_state_dict
    from hp_checkpoint.safetensors_shards import load_shards, save_shards

    src_model, src_opt, saved = _adamw_state(rank, world, "a", 3)
    path = save_shards(saved, root, 3)
    want = {("model", k): _full(v).clone() for k, v in saved["model"].items()}
    for fqn, st in saved["optim"]["state"].items():
        for k, v in st.items():
            want[(fqn, k)] = _full(v).clone()
    model, opt, target = _adamw_state(rank, world, "b", 0)  # fresh state, other layout, other lr
    load_shards(target, path)
    set_optimizer_state_dict(model, opt, target["optim"])
    got = {("model", k): _full(v) for k, v in dict(model.named_parameters()).items()}
    names = dict(model.named_parameters())
    for fqn, p in names.items():
        for k, v in opt.state[p].items():
            got[(fqn, k)] = _full(v)
    equal = sorted(k for k in want if k in got and torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype)
    restored = (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"], float(opt.state[names["w"]]["step"]))
    for s in (3, 4):  # the resumed run continues the uninterrupted one: AdamW is elementwise, so bit for bit
        _step(src_model, src_opt, s, "a")
        _step(model, opt, s, "b")
    mine = dict(src_model.named_parameters())
    continued = all(torch.equal(_full(p), _full(mine[k])) for k, p in model.named_parameters())
    return {"continued": continued, "equal": equal, "keys": sorted(want), "restored": restored}


def test_model_and_adamw_state_reshard_bit_equal(pool2: RankPool) -> None:
    root = tempfile.mkdtemp()
    try:
        for r in pool2.run(_optimizer_round_trip, root):
            assert r["keys"] == sorted([("model", "v"), ("model", "w")] + [
                (p, k) for p in ("v", "w") for k in ("exp_avg", "exp_avg_sq", "step")])
            assert r["equal"] == r["keys"], sorted(set(r["keys"]) - set(r["equal"]))
            assert r["restored"] == (1e-2, 0.1, 3.0)
            assert r["continued"], "two more steps after the resharded resume differ from the uninterrupted run"
        print(f"AdamW after 3 steps, saved Shard(0)/Shard(1), loaded Shard(1)/Replicate: "
              f"{len(r['keys'])} tensors bit-equal on 2 ranks, lr and weight decay restored, 2 more steps bit-equal to the uninterrupted run")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _attempt(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test compares the type and message)
        return f"{type(e).__name__}: {e}"
    return "ok"


def _misuse(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch

    from hp_checkpoint.safetensors_shards import load_shards, save_shards
    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(9)
    base = torch.randn(6, 5, generator=g)
    odd = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.5])
    odd = torch.cat([odd, torch.tensor([0.0]).view(torch.int32).add(0x7FC00001).view(torch.float32)])  # NaN payload
    state = {
        "t": distribute_tensor(base, mesh, [Shard(0)]).t(),  # (5, 6) Shard(1), a transposed view
        "layers/0.w": distribute_tensor(base * 2, mesh, [Shard(1)]),
        "odd": distribute_tensor(odd, mesh, [Shard(0)]),
        "odd_bf16": odd.to(torch.bfloat16),
        "meta": {"lr": float("nan"), "name": "x", "n": 3, "none": None, "flags": [True, -float("inf")]},
    }
    path = save_shards(state, root, 1)
    tgt_t = distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)]).t()  # Shard(1) of (5, 6), a view
    target = {"t": tgt_t, "layers/0.w": distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)]),
              "odd": torch.zeros(6), "odd_bf16": torch.zeros(6, dtype=torch.bfloat16),
              "meta": {"lr": 0.0, "name": "", "n": 0, "none": 1, "flags": [False, 0.0]}}
    load_shards(target, path)
    out["transposed"] = torch.equal(target["t"].full_tensor(), base.t()) and not target["t"].to_local().is_contiguous()
    out["slash"] = torch.equal(target["layers/0.w"].full_tensor(), base * 2)
    bits = odd.view(torch.int32)
    out["nan_bits"] = torch.equal(target["odd"].view(torch.int32), bits)
    out["nan_bf16_bits"] = torch.equal(target["odd_bf16"].view(torch.int16), odd.to(torch.bfloat16).view(torch.int16))
    m = target["meta"]
    out["values"] = (m["lr"] != m["lr"], m["name"], m["n"], m["none"], m["flags"][0], m["flags"][1])

    # loads that are refused or allowed
    def load(t: dict[str, Any], **kw: Any) -> None:
        load_shards(t, path, **kw)

    out["dtype"] = _attempt(lambda: load({**target, "odd": torch.zeros(6, dtype=torch.float64)}))
    out["missing_strict"] = _attempt(lambda: load({**target, "new.w": torch.ones(3)}))
    extra = {"new.w": torch.ones(3), "t": distribute_tensor(torch.zeros(5, 6), mesh, [Shard(0)])}
    out["missing_lax"] = _attempt(lambda: load(extra, strict=False))  # odd, meta... in the file, not asked for
    out["lax_values"] = (torch.equal(extra["new.w"], torch.ones(3)), torch.equal(extra["t"].full_tensor(), base.t()))
    out["value_missing"] = _attempt(lambda: load({**target, "meta": {**target["meta"], "mu": 0.5}}))
    frozen = {**target, "meta": {**target["meta"], "flags": (True, 0.0)}}  # a tuple cannot take -inf
    out["tuple"] = _attempt(lambda: load(frozen))
    same = {**target, "meta": {**target["meta"], "flags": (True, -float("inf"))}}  # but equal values pass
    out["tuple_same"] = _attempt(lambda: load(same))

    # saves that are refused
    out["object"] = _attempt(lambda: save_shards({"w": torch.ones(2), "opt": object()}, root, 2))
    out["complex"] = _attempt(lambda: save_shards({"z": torch.ones(2, dtype=torch.complex64)}, root, 2))
    out["pipe"] = _attempt(lambda: save_shards({"a|b": torch.ones(2)}, root, 2))
    afile = os.path.join(root, "afile")
    if rank == 0:
        open(afile, "w").close()
    torch.distributed.barrier()
    out["root_file"] = _attempt(lambda: save_shards({"w": torch.ones(2)}, afile, 2))
    out["negative"] = _attempt(lambda: save_shards({"w": torch.ones(2)}, root, -1))
    out["differ"] = _attempt(lambda: save_shards({"same": torch.ones(2), "seed": torch.tensor([rank])}, root, 2))
    out["dup"] = _attempt(lambda: save_shards({"a.b": torch.ones(2), "a": {"b": torch.ones(2)}}, root, 2))
    # a problem on one rank only is raised on both, not left for the other to wait on
    lone = {"w": torch.ones(2), **({"opt": object()} if rank == 1 else {})}
    out["one_rank_save"] = _attempt(lambda: save_shards(lone, root, 2))
    out["one_rank_load"] = _attempt(lambda: load({**target, "odd": torch.zeros(7 if rank == 1 else 6)}))
    out["after"] = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    return out


def test_careless_inputs_work_or_are_refused_on_every_rank(pool2: RankPool) -> None:
    root = tempfile.mkdtemp()
    try:
        results = pool2.run(_misuse, root)
        for r in results:
            for k in ("transposed", "slash", "nan_bits", "nan_bf16_bits"):
                assert r[k], k
            assert r["values"] == (True, "x", 3, None, True, -float("inf"))
            assert "tensor 'odd' is float32 of global shape (6,), but it is loaded into float64" in r["dtype"]
            assert r["missing_strict"].startswith("CheckpointError") and "has no tensor 'new.w'" in r["missing_strict"]
            assert r["missing_lax"] == "ok" and r["lax_values"] == (True, True)
            assert "has no value 'meta.mu'" in r["value_missing"]
            assert "value 'meta.flags.1' is -inf but the state dict holds 0.0 inside a tuple" in r["tuple"]
            assert r["tuple_same"] == "ok"
            assert "entry 'opt' is a object" in r["object"]
            assert "tensor name 'a|b' contains '|'" in r["pipe"]
            assert r["complex"].startswith("ValueError") and "tensor 'z': dtype torch.complex64 has no" in r["complex"]
            assert "afile' is a file, not a directory" in r["root_file"]
            assert r["negative"].startswith("ValueError") and "got -1" in r["negative"]
            assert "plain tensor 'seed' differs between ranks (rank 0 vs ranks [1])" in r["differ"]
            assert "have the path 'a.b'" in r["dup"]
            assert "rank 1: safetensors-shards: entry 'opt' is a object" in r["one_rank_save"]
            assert "tensor 'odd' is float32 of global shape (6,), but it is loaded into float32 of global shape (7,)" \
                in r["one_rank_load"]
            assert r["after"] == ["step-00000001"]
        assert results[0] == results[1]  # the same outcome and message on every rank
        print(f"careless inputs on 2 ranks: {len(results[0])} cases, each worked or was refused naming the value")
    finally:
        shutil.rmtree(root, ignore_errors=True)
