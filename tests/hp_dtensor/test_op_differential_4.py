"""The op differential suite (``op_diff_cases``) on 4 gloo ranks, meshes (4,) and (2, 2).

See ``test_op_differential_2``; here a Shard can split a dim over two mesh dims, and Partials
combine with shards across mesh dims.
"""

from __future__ import annotations

import os

# pytest puts this folder on sys.path; Pants' source root for it is /tests
from op_diff_cases import check, run_cases  # type: ignore[import-not-found]  # pants: no-infer-dep

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=900)
SCALE = float(os.environ.get("HP_OP_DIFF_SCALE", "1"))


def test_ops_match_plain_tensors_on_mesh_4(pool4: RankPool) -> None:
    check(pool4.run(run_cases, (4,), 4, SCALE * 0.6), (4,))


def test_ops_match_plain_tensors_on_mesh_2x2(pool4: RankPool) -> None:
    check(pool4.run(run_cases, (2, 2), 22, SCALE * 0.6), (2, 2))
