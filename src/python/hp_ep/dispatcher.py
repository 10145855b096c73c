"""Which token dispatcher an expert-parallel plan uses, and the node rule of the de-duplicating one.

``TokenDispatcher.ALLTOALL`` moves every routed token copy to its expert's rank by one all-to-all
(``ExpertParallel``).  ``TokenDispatcher.ALLTOALL_DEREDUNDANCY`` groups the ep ranks into nodes of
``npu_nums_per_device`` ranks and moves each token across nodes once per destination node, however
many of its experts live there (``DeredundancyExpertParallel``); it needs whole nodes, so
``expert_parallel >= npu_nums_per_device`` and divisible by it.
"""

from __future__ import annotations

import enum


class TokenDispatcher(enum.Enum):
    """The job file's ``moe_token_dispatcher_type`` values."""

    ALLTOALL = "alltoall"
    ALLTOALL_DEREDUNDANCY = "alltoall_deredundancy"

    @classmethod
    def from_name(cls, name: str) -> TokenDispatcher:
        """The dispatcher a job file names; ``ValueError`` listing the accepted names otherwise."""
        for kind in cls:
            if kind.value == name:
                return kind
        raise ValueError(
            f"moe_token_dispatcher_type must be one of {[k.value for k in cls]}, got {name!r}"
        )


def check_deredundancy_nodes(ep: int, npu_nums_per_device: int) -> int:
    """Nodes the ep group spans under ``alltoall_deredundancy``.  ``ValueError`` naming both numbers
    when ``npu_nums_per_device`` is below 1, above ``ep``, or does not divide it."""
    if npu_nums_per_device < 1:
        raise ValueError(f"npu_nums_per_device must be >= 1, got {npu_nums_per_device}")
    if ep < npu_nums_per_device:
        raise ValueError(
            f"moe_token_dispatcher_type alltoall_deredundancy needs expert_parallel ({ep}) >= "
            f"npu_nums_per_device ({npu_nums_per_device}); raise expert_parallel or use alltoall"
        )
    if ep % npu_nums_per_device:
        raise ValueError(
            f"moe_token_dispatcher_type alltoall_deredundancy needs expert_parallel ({ep}) to be a multiple of "
            f"npu_nums_per_device ({npu_nums_per_device}), so the ep group spans whole nodes; "
            f"pick an expert_parallel that is one"
        )
    return ep // npu_nums_per_device
