# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""What the MoE trainer tests under context and tensor parallelism run on each rank, and how they
check the parameters each rank holds."""

from __future__ import annotations

from math import prod
from typing import Any

from hp_models import train


def train_and_hold(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer's own path on this rank; how it holds each parameter (mesh dims and sizes,
    placements, local and whole element counts) and the blocks' token mesh."""
    from hp_dtensor import DTensor

    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    trained = train.fit(args, layout, config, rank, distributed=True, quiet=True)
    params = {}
    for name, p in trained.model.named_parameters():
        assert isinstance(p, DTensor), name  # every parameter is sharded (FSDP, TP or EP)
        params[name] = (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape), tuple(map(str, p.placements)),
                        p.to_local().numel(), p.numel())
    from hp_models.qwen3_5_moe.model import SparseMoeBlock

    token_mesh = next(m for m in trained.model.modules() if isinstance(m, SparseMoeBlock)).token_mesh
    return {"losses": trained.result["losses"], "load": trained.result["tokens_per_expert"],
            "layout": layout.as_dict(), "describe": layout.describe(), "params": params,
            "token_mesh": None if token_mesh is None else (token_mesh.mesh_dim_names, token_mesh.size())}


# (mesh dims, placements) of the routed experts' gate (up alike) and down tensors
EP = {"gate_proj": (("ep", "efsdp"), ("S(0)", "S(0)")), "down_proj": (("ep", "efsdp"), ("S(0)", "S(0)"))}
# each expert split as a TP MLP over etp (gate by column, down by row), then FSDP over edp
ETP = {"gate_proj": (("ep", "etp", "edp"), ("S(0)", "S(1)", "S(0)")),
       "down_proj": (("ep", "etp", "edp"), ("S(0)", "S(2)", "S(0)"))}


def check_shares(ranks: list[dict[str, Any]], experts: dict[str, Any], dense_dims: tuple[str, ...] = ("tp", "fsdp"),
                 expect: dict[str, tuple[str, ...]] | None = None) -> None:
    """Every parameter is held once per replica by the ranks of its mesh (all the ranks, or under
    pipeline parallelism those of its stage): over them its local elements add up to its size
    times the ranks it is replicated on (the mesh dims it is ``R`` on); dense parameters are on
    ``dense_dims``, sharded over fsdp (and as the TP plan says over tp); the experts as
    ``experts`` says; every rank holds ``1 / n`` of the routed experts' elements of its layers
    (``n`` the ranks of their mesh); ``expect`` pins named parameters' placements (by default
    the TP plan's on ``(tp, fsdp)``)."""
    names = sorted({name for r in ranks for name in r})
    for name in names:
        holders = [r[name] for r in ranks if name in r]
        dims, shape, placements, _, numel = holders[0]
        assert all(h[:3] == holders[0][:3] for h in holders), (name, holders)
        assert prod(shape) == len(holders), (name, dims, shape, len(holders))  # the mesh holds every holder
        replicas = prod(n for n, pl in zip(shape, placements) if pl == "R")
        held = sum(h[3] for h in holders)
        assert held == numel * replicas, (name, dims, placements, held, numel)
        kind = name.rsplit(".", 1)[-1]
        if ".experts." in name:
            if kind in experts:
                assert (dims, placements) == experts[kind], (name, dims, placements)
            assert placements.count("R") == 0, (name, placements)  # every expert element on one rank
        else:
            assert dims == dense_dims, (name, dims, placements)
            assert "fsdp" not in dims or placements[dims.index("fsdp")] == "S(0)", (name, dims, placements)
    for r in ranks:
        held = sum(v[3] for k, v in r.items() if ".experts." in k)
        total = sum(v[4] for k, v in r.items() if ".experts." in k)
        mesh_ranks = {prod(v[1]) for k, v in r.items() if ".experts." in k}
        assert len(mesh_ranks) == 1 and held * mesh_ranks.pop() == total, (held, total)
    layer = "model.layers.0.mlp."
    if expect is None:
        expect = {  # on (tp, fsdp): the router and the shared expert's gate replicated over tp, the
            # shared expert split as a TP MLP, the head over the vocab
            f"{layer}gate.weight": ("R", "S(0)"), f"{layer}shared_expert_gate.weight": ("R", "S(0)"),
            f"{layer}shared_expert.gate_proj.weight": ("S(0)", "S(0)"),
            f"{layer}shared_expert.down_proj.weight": ("S(1)", "S(0)"),
            "lm_head.weight": ("S(0)", "S(0)"),
        }
    for name, placements in expect.items():
        got = next(r[name][2] for r in ranks if name in r)
        assert got == placements, (name, got)


def check_equals_one_process(res: list[dict[str, Any]], argv: list[str], out: Any, seq: int, label: str) -> None:
    """Every rank reports the same run; its losses equal the trainer's one-process run of ``argv``
    (fp32, rtol 1.5e-4) and its tokens per expert equal it exactly, each of the 8 samples' ``seq``
    tokens routed to its top 2 experts once per layer and step (no rank routes a token another
    one routes)."""
    import torch
    from train_reference import single_process_run

    assert all(r["losses"] == res[0]["losses"] and r["load"] == res[0]["load"] for r in res)
    single = single_process_run(argv, out)
    load = res[0]["load"]
    assert load["copies_per_step"] == 8 * seq * 2 and all(sum(row) == 8 * seq * 2 for s in load["per_step"] for row in s)
    assert load["per_step"] == single["tokens_per_expert"]["per_step"], "tokens per expert differ from one process"
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(single["losses"]), rtol=1.5e-4,
                               atol=1e-5)
    worst = max(abs(a - b) / abs(b) for a, b in zip(res[0]["losses"], single["losses"]))
    steps = len(single["losses"])
    print(f"\n[{label}] {res[0]['describe']}: losses {res[0]['losses']}\n  one process {single['losses']}\n"
          f"  max rel diff {worst:.2e}; tokens per expert equal to one process in all {steps} steps")
