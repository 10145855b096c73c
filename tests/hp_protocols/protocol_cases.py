"""Framework-neutral checks shared by the torch and MindSpore protocol tests: the bad sharding
declarations ``Module.parallelize`` must refuse, and a snapshot of a module tree that shows
whether a failed call changed anything (parameter objects, buffers, the wrapped call, flags)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_dtensor import Replicate, Shard
from hp_dtensor.platform import current
from hp_protocols import LocalMapConfig, MeshAxisName, ShardingConfig

TP = MeshAxisName.TP


def good_up() -> ShardingConfig:
    """Column-parallel: weight [out, in] by rows, output sharded on its last dim."""
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}, "bias": {TP: Shard(0)}},
        in_dst_shardings={"input": {TP: Replicate()}},
    )


def good_down() -> ShardingConfig:
    """Row-parallel: weight by columns, input sharded on its last dim, output replicated."""
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(1)}},
        in_dst_shardings={"input": {TP: Shard(-1)}},
        out_dst_shardings={"output": {TP: Replicate()}},
    )


# (case, the bad declaration of the second module, error type, text the message holds)
BAD: list[tuple[str, ShardingConfig, type[Exception], str]] = [
    ("path", ShardingConfig(state_shardings={"nope": {TP: Shard(0)}}), ValueError, "'nope'"),
    ("axis", ShardingConfig(state_shardings={"weight": {"dp": Shard(0)}}), ValueError, "axes not in mesh: ['dp']"),
    ("dim", ShardingConfig(state_shardings={"weight": {TP: Shard(2)}}), ValueError, "shards dim 2"),
    ("arg", ShardingConfig(in_dst_shardings={"inp": {TP: Shard(-1)}}), ValueError, "argument 'inp'"),
    ("out", ShardingConfig(out_dst_shardings={"out": {TP: Replicate()}}), ValueError, "key 'out' is not 'output'"),
    ("local_map", ShardingConfig(local_map=LocalMapConfig()), NotImplementedError, "local_map will be added in M9"),
]


def snapshot(root: Any) -> dict[str, Any]:
    """Everything ``parallelize`` may change, by identity: each state's object, whether each
    module's call was replaced, each protocol module's flag."""
    plat = current()
    out: dict[str, Any] = {f"state:{k}": (id(v), type(v).__name__) for k, v in plat.state_dict(root).items()}
    for fqn, sub in plat.named_modules(root):
        out[f"call:{fqn}"] = plat.FORWARD in vars(sub)
        out[f"flag:{fqn}"] = getattr(sub, "_parallelized", None)
    return out


def fail_closed_cases(build: Callable[[ShardingConfig], Any], mesh: Any) -> list[tuple[str, str, bool]]:
    """For each bad declaration: (case, "<ErrorType>: message", tree unchanged?).  ``build(sc)``
    makes a fresh tree whose first module is valid and whose second carries ``sc``."""
    results = []
    for case, sc, exc, _ in BAD:
        tree = build(sc)
        before = snapshot(tree)
        try:
            tree.parallelize(mesh)
            msg = "no error"
        except exc as e:
            msg = f"{type(e).__name__}: {e}"
        results.append((case, msg, snapshot(tree) == before))
    tree = build(good_down())
    before = snapshot(tree)
    try:
        tree.parallelize("tp")
        msg = "no error"
    except TypeError as e:
        msg = f"TypeError: {e}"
    results.append(("mesh", msg, snapshot(tree) == before))
    return results


def assert_fail_closed(results: list[tuple[str, str, bool]]) -> None:
    expected = {case: (exc.__name__, text) for case, _, exc, text in BAD}
    expected["mesh"] = ("TypeError", "needs a DeviceMesh")
    assert [r[0] for r in results] == list(expected), results
    for case, msg, unchanged in results:
        name, text = expected[case]
        assert msg.startswith(name + ":") and text in msg, (case, msg)
        assert unchanged, f"{case}: parallelize raised but changed the module tree"
