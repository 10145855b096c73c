"""The op differential suite (``op_diff_cases``) on 2 gloo ranks, mesh (2,).

Every op with a sharding rule, every placement combination the seeded sample draws, forward and
input gradients against plain float64 tensors.  ``HP_OP_DIFF_SCALE=5`` samples five times as many
combinations per op (every one, for most ops).
"""

from __future__ import annotations

import os

# pytest puts this folder on sys.path; Pants' source root for it is /tests
from op_diff_cases import check, run_cases  # type: ignore[import-not-found]  # pants: no-infer-dep

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=600)
SCALE = float(os.environ.get("HP_OP_DIFF_SCALE", "1"))


def test_ops_match_plain_tensors_on_mesh_2(pool2: RankPool) -> None:
    check(pool2.run(run_cases, (2,), 2, SCALE), (2,))
