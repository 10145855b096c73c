"""Test harness for multi-rank code: a pool of real ranks, and fake-process-group meshes.

``RankPool(n)`` starts ``n`` rank processes once (gloo on CPU) and runs many test functions on
them; ``rank_pool_fixture(n)`` makes a module-scoped pytest fixture of it, whose ranks later
modules of the process share (``shared_pool``).  ``fake_world(n, rank)``
runs single-process geometry tests over the ``fake`` process group at any world size.
``outcomes(calls)`` records what each call raised, to compare across ranks.
``run_rank_scripts(code, n)`` runs a script as ``n`` fresh rank interpreters.
"""

from hp_dtensor.testing.fake import fake_world
from hp_dtensor.testing.outcomes import outcome, outcomes
from hp_dtensor.testing.rank_pool import (
    RankError,
    RankPool,
    RankTimeout,
    preload_in_fork_server,
    rank_pool_fixture,
    shared_pool,
)
from hp_dtensor.testing.rank_scripts import run_rank_scripts

__all__ = ["RankError", "RankPool", "RankTimeout", "fake_world", "outcome", "outcomes", "preload_in_fork_server", "rank_pool_fixture",
           "run_rank_scripts", "shared_pool"]
