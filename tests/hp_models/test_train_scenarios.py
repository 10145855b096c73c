# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
"""The data-parallel scenarios from their whole MindFormers job files on 4 gloo ranks: pure FSDP
(``data_parallel_shard: -1`` derived to 4) and HSDP (2 replicas x 2 shards) train 5 steps with the
losses of one process on the same data and weights (fp32, rtol 1.5e-4), on the meshes, process
groups and per-rank parameter shares the formulas give (dp_shard = world // (tp*pp*cp) for -1,
dp_replicate = world // (dp_shard*tp*cp*pp), each rank holding its ``torch.chunk`` share of every
parameter's rows over fsdp = dp_shard*cp ranks, replicas holding the same share).  A checkpoint
saved under DP+TP (2 x 2) resumes under HSDP and continues the one-process loss curve.  The README
command on the pure-FSDP file spawns its ranks, matches ``--compare-single`` and names the file's
ignored sections once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from train_reference import single_process_run

from hp_dtensor.testing import RankPool, rank_pool_fixture
from hp_models import train

pool4 = rank_pool_fixture(4, timeout=300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FSDP = str(EXAMPLES / "qwen3_5_fsdp.yaml")
HSDP = str(EXAMPLES / "qwen3_5_hsdp.yaml")
DP_TP = str(EXAMPLES / "qwen3_5_fsdp_tp.yaml")
STEPS = 5
SHORT = ["--nproc", "4", "--seq-len", "16", "--lr", "1e-2", "--checkpoint-every", "100"]


def _close(got: list[float], want: list[float]) -> float:
    """Assert fp32 closeness; returns the largest relative difference."""
    import torch

    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1.5e-4, atol=1e-5)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """One process, the whole global batch of 8 per step: every job here has that batch."""
    out = tmp_path_factory.mktemp("single")
    return single_process_run(["--job", FSDP, "--steps", str(STEPS), *SHORT], out)["losses"]  # type: ignore[no-any-return]


def _train_and_describe(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """This rank's mesh groups and parameter shares as the trainer builds them, then its losses."""
    args = train.parse_args(argv)
    config, layout = train.check_args(args)
    dense, _ = layout.dims.build_mesh("cpu")
    groups = {name: dense.group_ranks(k) for k, name in enumerate(dense.mesh_dim_names)}
    model, _ = train.build_model(args, layout, config, distributed=True)
    coord = dense.get_coordinate()
    shares = {name: {"global": tuple(p.shape), "local": tuple(p.to_local().shape), "mesh": p.device_mesh.shape,
                     "placements": [type(q).__name__ + (f"({q.dim})" if hasattr(q, "dim") else "") for q in p.placements]}
              for name, p in model.named_parameters()}
    del model
    out = train.train(args, layout, config, rank, distributed=True, quiet=True)
    return {"layout": layout.as_dict(), "groups": groups, "coord": coord, "shares": shares, "losses": out["losses"],
            "start": out["start_step"]}


def _rows(n: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` ranks under ``torch.chunk`` (the reference split)."""
    import torch

    lengths = [len(c) for c in torch.chunk(torch.arange(n), parts)]
    return lengths + [0] * (parts - len(lengths))


@pytest.mark.parametrize("job,dims,groups", [
    (FSDP, {"dp_replicate": 1, "dp_shard": 4, "accumulation_steps": 2},
     {"pp": {(0,), (1,), (2,), (3,)}, "dp_replicate": {(0,), (1,), (2,), (3,)}, "fsdp": {(0, 1, 2, 3)},
      "tp": {(0,), (1,), (2,), (3,)}}),
    (HSDP, {"dp_replicate": 2, "dp_shard": 2, "accumulation_steps": 1},
     {"pp": {(0,), (1,), (2,), (3,)}, "dp_replicate": {(0, 2), (1, 3)}, "fsdp": {(0, 1), (2, 3)},
      "tp": {(0,), (1,), (2,), (3,)}}),
], ids=["1.4A-pure-fsdp", "1.4B-hsdp"])
def test_scenario_equals_one_process_on_the_formulas_meshes(pool4: RankPool, reference: list[float], job: str,
                                                             dims: dict[str, int], groups: dict[str, set], tmp_path) -> None:
    res = pool4.run(_train_and_describe, ["--job", job, "--steps", str(STEPS), "--out-dir", str(tmp_path), *SHORT])
    world = 4
    replicate, shard = dims["dp_replicate"], dims["dp_shard"]
    assert replicate == world // (shard * 1 * 1 * 1)  # dp_replicate = world / (dp_shard*tp*cp*pp)
    for key, value in {**dims, "world_size": world, "tp": 1}.items():
        assert res[0]["layout"][key] == value, (key, res[0]["layout"])
    for name, want in groups.items():
        assert {tuple(r["groups"][name]) for r in res} == want, name
    # every parameter: Shard(0) over fsdp (Replicate over dp_replicate first under HSDP); each rank
    # holds its torch.chunk rows of dim 0 and replicas hold the same rows
    mesh = (replicate, shard) if replicate > 1 else (shard,)
    placements = (["Replicate"] if replicate > 1 else []) + ["Shard(0)"]
    total = held = 0
    for name, share in res[0]["shares"].items():
        n = share["global"][0]
        rows = _rows(n, shard)
        total += _numel(share["global"])
        for r in res:
            got = r["shares"][name]
            assert (tuple(got["mesh"]), got["placements"]) == (mesh, placements), (name, got)
            local = (rows[r["coord"][2]],) + tuple(share["global"][1:])
            assert tuple(got["local"]) == local, (name, r["coord"], got["local"], local)
            held += _numel(got["local"])
    assert held == total * replicate  # the shards of each replica add up to the whole model once
    assert all(r["losses"] == res[0]["losses"] for r in res)
    worst = _close(res[0]["losses"], reference)
    print(f"\n[scenario] {Path(job).name}: dp_replicate={replicate} x dp_shard={shard}, {len(res[0]['shares'])} "
          f"parameters, {total:,} elements, {held // world:,} per rank; {STEPS} steps max rel diff vs one process "
          f"{worst:.2e}")


def _numel(shape: Any) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_checkpoint_of_dp_tp_resumes_under_hsdp(pool4: RankPool, reference: list[float], tmp_path) -> None:
    """DP+TP (dp_shard 2 x tp 2) saves at step 3; HSDP (2 replicas x 2 shards, no TP) resumes to 5:
    the first 3 losses are the saved run's and the curve continues the one-process one."""
    # the 2.4 example with the HSDP file's AdamW (its optimizer: section): a resume continues only the same AdamW
    dp_tp = tmp_path / "dp_tp.yaml"
    dp_tp.write_text(Path(DP_TP).read_text() + "\noptimizer: {type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, "
                                               "weight_decay: 0.0}\n")
    part = pool4.run(_train_and_describe, ["--job", str(dp_tp), "--steps", "3", "--out-dir", str(tmp_path), *SHORT])
    resumed = pool4.run(_train_and_describe, ["--job", HSDP, "--steps", str(STEPS), "--out-dir", str(tmp_path),
                                              "--resume", *SHORT])
    assert (part[0]["layout"]["tp"], part[0]["layout"]["dp_shard"]) == (2, 2)
    assert (resumed[0]["layout"]["dp_replicate"], resumed[0]["layout"]["dp_shard"]) == (2, 2)
    losses = resumed[0]["losses"]
    assert resumed[0]["start"] == 3 and losses[:3] == part[0]["losses"]
    worst = _close(losses, reference)
    print(f"\n[scenario resume] dp+tp 2x2 saved step 3, hsdp 2x2 resumed to {STEPS}: max rel diff vs one process "
          f"{worst:.2e}")


def test_readme_command_spawns_matches_one_process_and_notes_once(reference: list[float], tmp_path, capfd) -> None:
    out = tmp_path / "run"
    assert train.main(["--job", FSDP, "--steps", str(STEPS), "--out-dir", str(out), "--compare-single", *SHORT]) == 0
    log = json.loads((out / "log.json").read_text())
    assert log["parallelism"]["dp_shard"] == 4 and log["single_losses"] == pytest.approx(reference, rel=1e-6)
    _close(log["losses"], reference)
    err = capfd.readouterr().err
    assert err.count("note: job file") == 1, err
    assert "ignored: section(s) checkpoint, context;" in err  # (optimizer: and lr_scheduler: are read)
    assert "training: max_norm, seed, steps" in err
