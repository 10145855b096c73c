"""Every import path that moved keeps working for one minor version, with a DeprecationWarning.

Each old dotted path must import the very module object the new path names (so ``isinstance``,
monkeypatching and module state stay shared), warn once naming the new path, and leave the new
module's own ``__spec__`` intact.  Run in a fresh interpreter per check so that no earlier import
has already bound the old name.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

MOVED = {
    "hp_dtensor.mesh_layout": "hp_dtensor.layout.mesh_layout",
    "hp_dtensor.shard_geometry": "hp_dtensor.layout.shard_geometry",
    "hp_dtensor.dtensor_spec": "hp_dtensor.layout.dtensor_spec",
    "hp_dtensor.checkpoint_layout": "hp_dtensor.layout.shard_boxes",
    "hp_dtensor.redistribute_planner": "hp_dtensor.redistribute.planner",
    "hp_dtensor.redistribute_exec": "hp_dtensor.redistribute.executor",
    "hp_dtensor.dispatch_core": "hp_dtensor.sharding.dispatch",
    "hp_dtensor.dtensor_methods": "hp_dtensor.api.dtensor_methods",
    "hp_dtensor.from_local_check": "hp_dtensor.api.from_local_check",
    "hp_dtensor.rng_tracker": "hp_dtensor.api.rng_tracker",
    "hp_dtensor.mesh_exchange": "hp_dtensor.api.mesh_exchange",
    "hp_dtensor.loss_parallel_kernel": "hp_tp.loss_parallel_kernel",
    "hp_dtensor.loss_parallel_rules": "hp_tp.loss_parallel_rules",
    "hp_dtensor.checkpoint": "hp_checkpoint.dcp",
    "hp_dtensor.checkpoint_atomic": "hp_checkpoint.atomic",
    "hp_dtensor.checkpoint_async": "hp_checkpoint.async_save",
    "hp_dtensor.checkpoint_faults": "hp_checkpoint.faults",
    "hp_dtensor.checkpoint_manifest": "hp_checkpoint.manifest",
    "hp_dtensor.safetensors_shards": "hp_checkpoint.safetensors_shards",
    "hp_dtensor.gather_to_rank": "hp_checkpoint.gather_to_rank",
    "hp_dtensor.export_plan": "hp_checkpoint.export_plan",
    "hp_protocols.hf_export": "hp_checkpoint.hf_export",
}

_CHECK = textwrap.dedent(
    """
    import importlib, json, sys, warnings
    moved = json.loads(sys.argv[1])
    report = {}
    for old, new in moved.items():
        parent = old.rpartition(".")[0]
        importlib.import_module(parent)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            was = importlib.import_module(old)
            again = importlib.import_module(old)
        now = importlib.import_module(new)
        report[old] = {
            "same": was is now and again is now,
            "spec": now.__spec__.name,
            "warnings": [(w.category.__name__, str(w.message)) for w in caught],
        }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import hp_dtensor, hp_tp
        attr = hp_dtensor.loss_parallel
    report["hp_dtensor.loss_parallel"] = {
        "same": attr is hp_tp.loss_parallel, "spec": "",
        "warnings": [(w.category.__name__, str(w.message)) for w in caught],
    }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report() -> dict[str, dict[str, object]]:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _CHECK, json.dumps(MOVED)], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module(report: dict[str, dict[str, object]], old: str) -> None:
    row = report[old]
    new = MOVED[old]
    assert row["same"], f"{old} did not import {new}"
    assert row["spec"] == new, f"{new}'s __spec__ was replaced by {row['spec']!r}"
    warned = row["warnings"]
    assert isinstance(warned, list) and len(warned) == 1, warned
    kind, message = warned[0]
    assert kind == "DeprecationWarning"
    assert f"{old} moved to {new}" in message and "removed in" in message


def test_loss_parallel_attribute_moved(report: dict[str, dict[str, object]]) -> None:
    row = report["hp_dtensor.loss_parallel"]
    assert row["same"]
    assert row["warnings"] and row["warnings"][0][0] == "DeprecationWarning"  # type: ignore[index]
    assert "hp_tp.loss_parallel" in row["warnings"][0][1]  # type: ignore[index]


def test_new_paths_import_without_warnings() -> None:
    code = (
        "import importlib, warnings, sys\n"
        "warnings.simplefilter('error')\n"
        "[importlib.import_module(n) for n in sys.argv[1:]]\n"
    )
    subprocess.run([sys.executable, "-c", code, *sorted(set(MOVED.values()))], check=True, timeout=120)
