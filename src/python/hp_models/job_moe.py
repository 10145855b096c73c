"""The expert-parallel part of a training job: which dispatcher, and what the trainer refuses.

Pure (no framework).  ``hp_protocols``' ``JobConfig.resolve`` already checks the parallelism
config's own rules (``expert_parallel`` dividing ``dp_shard * cp * tp``, the deredundancy
dispatcher needing ``expert_parallel`` to be a whole number of ``npu_nums_per_device`` nodes); on
top of them this module refuses, before any rank starts, what the trainer cannot run with the
model actually built: expert parallelism on a dense model and an expert count the ep size does
not divide.  Packed documents, which the MoE step cannot keep apart, are refused where the data
settings are known (``hp_models.job``), as is the MoE model under pipeline parallelism in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_ep.dispatcher import TokenDispatcher
from hp_protocols.parallelism import ParallelDims, ParallelismConfig


@dataclass(frozen=True)
class MoeSettings:
    """A mixture-of-experts run's expert-parallel settings, validated."""

    num_experts: int
    ep: int
    efsdp: int
    dispatcher: TokenDispatcher
    npu_nums_per_device: int
    # Ranks splitting each expert like a TP MLP (ep <= tp: the TP ranks sharing an ep coordinate);
    # 1 with the deredundancy dispatcher, which moves whole experts' tokens only.
    etp: int = 1

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def edp(self) -> int:
        """The ranks the experts are fully sharded over: ``efsdp`` less its ``etp`` part."""
        return self.efsdp // self.etp


def check_moe_job(p: ParallelismConfig, dims: ParallelDims, num_experts: int | None) -> MoeSettings | None:
    """The run's ``MoeSettings`` (None for a dense model, ``num_experts`` None); ``ValueError``
    naming the value and what to change for a job the trainer cannot run."""
    if num_experts is None:
        if dims.ep > 1:
            raise ValueError(
                f"expert_parallel={dims.ep} needs a mixture-of-experts model, but the model being trained is dense; "
                f"pass --config tiny-moe (or a qwen3_5_moe config.json), or set expert_parallel: 1"
            )
        return None
    if num_experts % dims.ep:
        raise ValueError(
            f"expert_parallel={dims.ep} does not divide the model's {num_experts} experts (each ep rank holds "
            f"num_experts // ep of them); pick an expert_parallel that divides {num_experts}"
        )
    # (resolve() checked the name and, for deredundancy, that ep is a whole number of nodes)
    dispatcher = TokenDispatcher.from_name(p.moe_token_dispatcher_type)
    etp = dims.etp if dispatcher is TokenDispatcher.ALLTOALL else 1
    return MoeSettings(num_experts=num_experts, ep=dims.ep, efsdp=dims.efsdp, dispatcher=dispatcher,
                       npu_nums_per_device=p.npu_nums_per_device, etp=etp)
