# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Styled Linear layers that take a plain tensor in and give one out (Colwise on a replicated
input with its local output, Rowwise on a local shard with its replicated output) make no DTensor
on the way: the style's hooks hand the local forward the plain tensor and the two Megatron
operators stand at the edges.  Over generated cases (uneven feature counts, biases, 1-3-d
inputs, float32/float64, inputs with and without gradient, no_grad and inference mode) that path
gives bit for bit the values, input gradients and parameter gradients of the DTensor path
(forced by a hook of the user's on each layer, which turns the plain path off), with the same
collectives, and equals one process in float64; so it does under activation checkpointing and
bf16 autocast.  Any other hook on the layer turns the path off.  An input whose last dim is not
the rank's share goes the DTensor way and fails as it does there.  Cases are counted in the
output."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)
CASES = 160


def _mlp(hidden: int, ffn: int, bias: bool, dtype: Any) -> Any:
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(hidden, ffn, bias=bias, dtype=dtype)
            self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
            self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

        def forward(self, x: Any) -> Any:
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    return MLP()


def _styled(ref: Any, mesh: Any, dtensor_path: bool) -> Any:
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    if dtensor_path:  # a hook of the user's: the layer's inputs and outputs must be what it expects
        for m in (model.gate_proj, model.up_proj, model.down_proj):
            m.register_forward_hook(lambda mod, inp, out: None)
    return model


class _Edges:
    """Counts the Megatron edge operators the plain path runs."""

    def __enter__(self) -> _Edges:
        from hp_tp.platform.torch import local_layers as k

        self.k, self.n = k, {"replicate_input": 0, "sum_partial_output": 0}
        self._orig = {name: getattr(k, name) for name in self.n}
        for name, fn in self._orig.items():
            def counted(*a: Any, _name: str = name, _fn: Any = fn) -> Any:
                self.n[_name] += 1
                return _fn(*a)

            setattr(k, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._orig.items():
            setattr(self.k, name, fn)


def _run(model: Any, x: Any, mode: str) -> tuple[Any, Any, dict[str, Any], dict[str, int], dict[str, int]]:
    import torch

    from hp_dtensor import CommDebugMode

    xi = x.clone().requires_grad_(mode == "grad")
    with CommDebugMode() as comm, _Edges() as edges:
        if mode == "no_grad":
            with torch.no_grad():
                y = model(xi)
        elif mode == "inference":
            with torch.inference_mode():
                y = model(xi)
        else:  # "grad", or "input_without_grad": only the parameters get gradients
            y = model(xi)
            (y * torch.arange(1, y.numel() + 1, dtype=y.dtype).reshape(y.shape)).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return y, xi.grad, grads, comm.get_comm_counts(), edges.n


def _cases(rank: int, world: int, n: int) -> dict[str, Any]:
    import torch

    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    rng = random.Random(31)
    worst, plain_runs, dtensor_runs = 0.0, 0, 0
    for case in range(n):
        hidden, ffn = rng.choice([4, 6, 9, 16]), rng.choice([3, 5, 8, 12, 33])
        dtype = rng.choice([torch.float32, torch.float64])
        lead = rng.choice([(), (5,), (2, 3)])
        mode = rng.choice(["grad", "grad", "grad", "no_grad", "inference", "input_without_grad"])
        torch.manual_seed(case)
        ref = _mlp(hidden, ffn, rng.random() < 0.5, dtype)
        x = torch.randn(*lead, hidden, dtype=dtype)
        got = _run(_styled(ref, mesh, False), x, mode)
        want = _run(_styled(ref, mesh, True), x, mode)
        where = f"case {case}: hidden={hidden} ffn={ffn} {dtype} lead={lead} {mode}"
        assert torch.equal(got[0], want[0]), where
        assert (got[1] is None and want[1] is None) or torch.equal(got[1], want[1]), where
        assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][k], want[2][k]) for k in got[2]), where
        assert got[3] == want[3], (where, got[3], want[3])  # the same collectives
        assert want[4] == {"replicate_input": 0, "sum_partial_output": 0}, where  # the hook forced DTensors
        assert got[4]["sum_partial_output"] == 1, where  # the plain path ran
        plain_runs += 1
        dtensor_runs += 1
        # and one process, in float64
        r64 = copy.deepcopy(ref).double()
        x64 = x.double().requires_grad_(mode == "grad")
        y64 = r64(x64)
        worst = max(worst, float((got[0].double() - y64.detach()).abs().max()))
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got[0].double(), y64.detach(), rtol=tol, atol=tol, msg=where)
        if mode in ("grad", "input_without_grad"):
            assert got[2], where
            (y64 * torch.arange(1, y64.numel() + 1, dtype=y64.dtype).reshape(y64.shape)).sum().backward()
            if mode == "grad":
                torch.testing.assert_close(got[1].double(), x64.grad, rtol=tol * 10, atol=tol * 10, msg=where)
            for name, p in r64.named_parameters():
                torch.testing.assert_close(got[2][name].double(), p.grad, rtol=tol * 10, atol=tol * 10, msg=where)
    return {"cases": n, "plain": plain_runs, "dtensor": dtensor_runs, "worst": worst}


def test_plain_path_equals_the_dtensor_path_and_one_process(pool2: RankPool) -> None:
    out = pool2.run(_cases, CASES)
    assert all(r["cases"] == CASES for r in out)
    print(f"\nplain in/out TP layers: {CASES} generated cases per rank, bit-equal to the DTensor path (values, input "
          f"and parameter gradients, collectives); vs one process in float64: worst |diff| "
          f"{max(r['worst'] for r in out):.1e}")


def _shared_input_and_mismatch(rank: int, world: int) -> dict[str, Any]:
    import torch

    from hp_dtensor import CommDebugMode, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _styled(_mlp(8, 16, False, torch.float32), mesh, False)
    x = torch.randn(4, 8, requires_grad=True)
    with CommDebugMode() as fwd:
        y = model(x)
    with CommDebugMode() as bwd:
        y.sum().backward()
    out: dict[str, Any] = {"fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts()}
    # a rowwise layer given a plain input that is not this rank's share of in_features (8 of 16)
    errors = []
    for dtensor_path in (False, True):
        m = _styled(_mlp(8, 16, False, torch.float32), mesh, dtensor_path)
        try:
            m.down_proj(torch.randn(4, 16))
        except Exception as e:  # noqa: BLE001
            errors.append(type(e).__name__)
    out["errors"] = errors
    return out


def test_one_gradient_reduction_for_a_shared_input_and_a_bad_shard_fails_as_before(pool2: RankPool) -> None:
    for r in pool2.run(_shared_input_and_mismatch):
        # gate and up take the same input: one all_reduce of its gradient, as a Megatron MLP
        assert r["fwd"] == {"all_reduce": 1} and r["bwd"] == {"all_reduce": 1}, r
        assert len(r["errors"]) == 2 and r["errors"][0] == r["errors"][1], r["errors"]


@pytest.mark.parametrize("hook", ["pre", "backward"])
def test_any_other_hook_turns_the_plain_path_off(pool2: RankPool, hook: str) -> None:
    for r in pool2.run(_other_hook, hook):
        assert r == {"edges": 0, "saw": "DTensor"}, r


def _other_hook(rank: int, world: int, hook: str) -> dict[str, Any]:
    import torch

    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _styled(_mlp(8, 16, False, torch.float32), mesh, False)
    seen: list[str] = []
    if hook == "pre":  # runs after the style's pre-hook: sees what the forward will get
        model.gate_proj.register_forward_pre_hook(lambda m, inp: seen.append(type(inp[0]).__name__))
    else:
        model.gate_proj.register_full_backward_hook(lambda m, gi, go: None)
        model.gate_proj.register_forward_hook(lambda m, inp, out: seen.append(type(inp[0]).__name__))
    with _Edges() as edges:
        model.gate_proj(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return {"edges": edges.n["replicate_input"], "saw": seen[0]}


def _checkpointed_and_autocast(rank: int, world: int) -> dict[str, Any]:
    """Under activation checkpointing (non-reentrant, the recompute takes the same input) and
    under bf16 autocast, the plain path gives the DTensor path's values and gradients bit for bit."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from hp_dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in ("checkpoint", "autocast"):
        torch.manual_seed(7)
        ref = _mlp(12, 20, True, torch.float32)
        x = torch.randn(3, 5, 12)
        runs = []
        for dtensor_path in (False, True):
            model = _styled(ref, mesh, dtensor_path)
            xi = x.clone().requires_grad_(True)
            with _Edges() as edges:
                if name == "checkpoint":
                    y = checkpoint(model, xi, use_reentrant=False)
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        y = model(xi)
                y.float().square().sum().backward()
            runs.append((y, xi.grad, {n: p.grad.full_tensor() for n, p in model.named_parameters()}, edges.n))
        (y0, g0, p0, e0), (y1, g1, p1, e1) = runs
        out[name] = (torch.equal(y0, y1) and torch.equal(g0, g1) and all(torch.equal(p0[k], p1[k]) for k in p0),
                     e0["sum_partial_output"] >= 1, e1["sum_partial_output"] == 0, str(y0.dtype))
    return out


def test_checkpointing_and_autocast_keep_the_plain_path_exact(pool2: RankPool) -> None:
    for r in pool2.run(_checkpointed_and_autocast):
        assert r["checkpoint"][:3] == (True, True, True), r
        assert r["autocast"] == (True, True, True, "torch.bfloat16"), r
