"""hp_ep: expert parallelism for mixture-of-experts models.

``ExpertParallel`` is a parallel style for ``hp_tp.parallelize_module``: it shards a module's
stacked experts over a 1-D ep mesh and moves each token to the rank holding its expert by an
all-to-all of variable counts (counts exchanged first), dropless, with exact gradients.
"""

from hp_ep.dispatch import DispatchPlan, check_experts_divisible
from hp_ep.style import ExpertParallel

__version__ = "0.1.0"

__all__ = ["DispatchPlan", "ExpertParallel", "check_experts_divisible"]
