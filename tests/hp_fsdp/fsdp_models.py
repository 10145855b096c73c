# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Models and one training routine shared by the fully_shard tests.

``run_case(rank, world, cfg)`` builds the same small transformer-like model on every rank and on a
one-process reference (same weights, float32), shards it as ``cfg`` says (FSDP, HSDP, TP + FSDP),
trains a few AdamW steps on per-rank slices of one global batch and returns what the tests
assert: the largest differences of losses, gradients and parameters against the reference, the
collectives of each step and the bytes this rank holds.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

RTOL, ATOL = 1.5e-4, 1e-5
GROUPS = 4  # fully_shard groups of Net when nested: three blocks and the root


def check_numbers(results: list[dict[str, Any]], loss_rtol: float = 1.5e-4) -> None:
    """Every rank's gradients and parameters within fp32 tolerance of one process, and the mean of
    the ranks' losses (each a mean over its slice of the batch) equal to the one-process loss."""
    for r in results:
        assert r["names_match"]
        assert r["worst"]["grad"] <= 1.0, r["worst"]
        assert r["worst"]["param"] <= 1.0, r["worst"]
    n = len(results)
    for step, ref in enumerate(results[0]["ref_losses"]):
        ours = sum(r["losses"][step] for r in results) / n
        assert abs(ours - ref) <= 1e-6 + loss_rtol * abs(ref), (step, ours, ref)


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Uneven by design: no dim 0 below divides by 2 or 4 (out.weight has 3 rows: 4 ranks get
    1, 1, 1 and 0)."""

    def __init__(self, d_in: int = 5, d: int = 10, h: int = 6, d_out: int = 3, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(blocks)])
        self.out = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@dataclass
class Case:
    kind: str = "fsdp"  # fsdp | hsdp | c15 (TP on mesh['tp'], then FSDP on mesh['dp']) | hsdp_tp
    nested: bool = True  # fully_shard each block, then the root
    reshard: bool | None = None  # None: fully_shard's default (all but the root)
    steps: int = 3
    micro: int = 1  # gradient accumulation micro-steps (sync off on all but the last)
    batch: int = 8
    param_dtype: str | None = None  # "bfloat16": mixed precision (fp32 reduce, fp32 master)
    divide_factor: float | None = None
    seed: int = 0
    compare_grads_each_step: bool = True
    hidden: int = 6  # the blocks' hidden size (TP splits it: 7 is uneven over 2)
    scaled_tol: float | None = None  # bf16: |a-b| <= scaled_tol * max|b| per tensor instead of fp32's rule
    extra: dict[str, Any] = field(default_factory=dict)


def _mesh(world: int, kind: str) -> tuple[Any, Any, Any, int, int]:
    """(fully_shard mesh, tp mesh or None, root mesh, dp size, this rank's dp index)."""
    from hp_dtensor import init_device_mesh

    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        return mesh, None, mesh, world, mesh.get_local_rank(0)
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp_index = mesh.get_local_rank(0) * mesh.size(1) + mesh.get_local_rank(1)
        return mesh, None, mesh, world, dp_index
    if kind == "c15":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"], mesh, world // 2, mesh.get_local_rank(0)
    if kind == "hsdp_tp":  # (dp_replicate, dp_shard, tp) = (2, world // 4, 2)
        mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_index = mesh.get_local_rank(0) * mesh.size(1) + mesh.get_local_rank(1)
        return mesh["dp_replicate", "dp_shard"], mesh["tp"], mesh, world // 2, dp_index
    raise ValueError(kind)


def _full(t: Any) -> torch.Tensor:
    from hp_dtensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor, scaled_tol: float | None = None) -> float:
    """Largest violation of |a-b| <= ATOL + RTOL*|b| (or, with ``scaled_tol``, of
    |a-b| <= scaled_tol * max|b|), as a multiple of the allowance: <= 1 passes."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if not a.numel():
        return 0.0
    if scaled_tol is not None:
        return float((a - b).abs().max() / (scaled_tol * b.abs().max() + ATOL))
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards)."""
    from hp_dtensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        local = t._local_tensor if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    total = 0
    for p in model.parameters():
        total += nbytes(p)
        if p.grad is not None:
            total += nbytes(p.grad)
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                total += nbytes(v)
    return total


def _share_bytes(ref: nn.Module, fsdp_mesh: Any) -> int:
    """This rank's exact share of one copy of the (non-TP) model: dim 0 of every parameter split
    torch.chunk-style over the shard group."""
    from hp_dtensor.layout.shard_geometry import chunk_size_and_offset

    n = fsdp_mesh.size(fsdp_mesh.ndim - 1)
    index = fsdp_mesh.get_local_rank(fsdp_mesh.ndim - 1)
    total = 0
    for p in ref.parameters():
        rows, _start = chunk_size_and_offset(p.shape[0], n, index)
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def run_case(rank: int, world: int, cfg: Case) -> dict[str, Any]:
    from hp_dtensor import CommDebugMode
    from hp_fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(cfg.seed)
    ref = Net(h=cfg.hidden)
    model = copy.deepcopy(ref)
    fsdp_mesh, tp_mesh, _root, dp, dp_index = _mesh(world, cfg.kind)
    if tp_mesh is not None:
        from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

        for b in model.blocks:
            parallelize_module(b, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    mp = MixedPrecisionPolicy()
    if cfg.param_dtype:
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.param_dtype), reduce_dtype=torch.float32)
    if cfg.nested:
        for b in model.blocks:
            fully_shard(b, mesh=fsdp_mesh, reshard_after_forward=cfg.reshard, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=cfg.reshard, mp_policy=mp)
    if cfg.divide_factor is not None:
        model.set_gradient_divide_factor(cfg.divide_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)

    gen = torch.Generator().manual_seed(100 + cfg.seed)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    losses, ref_losses, comms = [], [], []
    for _step in range(cfg.steps):
        x = torch.randn(cfg.micro, cfg.batch, 5, generator=gen)
        y = torch.randn(cfg.micro, cfg.batch, 3, generator=gen)
        step_comm: dict[str, int] = {}
        step_loss = 0.0
        for m in range(cfg.micro):
            last = m == cfg.micro - 1
            model.set_requires_gradient_sync(last)
            xs, ys = x[m].chunk(dp)[dp_index], y[m].chunk(dp)[dp_index]
            with CommDebugMode() as comm:
                loss = ((model(xs) - ys) ** 2).mean() / cfg.micro
                loss.backward()
            for k, v in comm.get_comm_counts().items():
                step_comm[f"{k}@{m}"] = step_comm.get(f"{k}@{m}", 0) + v
            step_loss += float(loss.detach())
        ref_loss = 0.0
        for m in range(cfg.micro):
            rl = ((ref(x[m]) - y[m]) ** 2).mean() / cfg.micro
            rl.backward()
            ref_loss += float(rl.detach())
        if cfg.divide_factor is not None:  # a sum over dp ranks instead of a mean
            for p in ref.parameters():
                p.grad.mul_(dp / cfg.divide_factor)
        if cfg.compare_grads_each_step:
            for p, rp in zip(model.parameters(), ref.parameters()):
                worst["grad"] = max(worst["grad"], _rel(_full(p.grad), rp.grad, cfg.scaled_tol))
        opt.step()
        ropt.step()
        held = held_bytes(model, opt)  # parameters, gradients and AdamW state, before zero_grad
        opt.zero_grad()
        ropt.zero_grad()
        losses.append(step_loss)
        ref_losses.append(ref_loss)
        comms.append(step_comm)
    # Per-rank loss is a mean over this rank's slice: the global loss is their mean over dp.
    for p, rp in zip(model.parameters(), ref.parameters()):
        worst["param"] = max(worst["param"], _rel(_full(p), rp, cfg.scaled_tol))
    names = [n for n, _ in model.named_parameters()]
    ref_names = [n for n, _ in ref.named_parameters()]
    return {
        "worst": worst, "losses": losses, "ref_losses": ref_losses, "comms": comms,
        "names_match": names == ref_names, "held": held,
        "full_bytes": sum(p.numel() * p.element_size() for p in ref.parameters()),
        "share_bytes": _share_bytes(ref, fsdp_mesh),
        "placements": {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()},
        "mesh_names": {n: p.device_mesh.mesh_dim_names for n, p in model.named_parameters()},
    }
