"""hp_ep: expert parallelism for mixture-of-experts models.

``ExpertParallel`` is a parallel style for ``hp_tp.parallelize_module``: it shards a module's
stacked experts over a 1-D ep mesh and moves each token to the rank holding its expert by an
all-to-all of variable counts (counts exchanged first), dropless, with exact gradients.
``DeredundancyExpertParallel`` shards the same way and moves each token across nodes of
``npu_nums_per_device`` ranks once per destination node (``TokenDispatcher.ALLTOALL_DEREDUNDANCY``);
``make_expert_parallel`` picks the style of a ``TokenDispatcher``.  ``ExpertTensorParallel``
adds a TP split inside each expert over the ``etp`` ranks that share an ep coordinate.
"""

from hp_ep.deredundancy import DeredundancyPlan
from hp_ep.deredundancy_style import DeredundancyExpertParallel, ExpertParallelStyle, make_expert_parallel
from hp_ep.dispatch import DispatchPlan, check_experts_divisible
from hp_ep.dispatcher import TokenDispatcher, check_deredundancy_nodes
from hp_ep.etp import ExpertTensorParallel, ep_etp_mesh
from hp_ep.style import ExpertParallel

__version__ = "0.1.0"

__all__ = [
    "DeredundancyExpertParallel", "DeredundancyPlan", "DispatchPlan", "ExpertParallel", "ExpertParallelStyle",
    "ExpertTensorParallel", "TokenDispatcher", "check_deredundancy_nodes", "check_experts_divisible",
    "ep_etp_mesh", "make_expert_parallel",
]
