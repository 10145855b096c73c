"""Run by check_wheels.sh under torchrun (2 gloo ranks) in a venv holding only hp-pp and
hp-dtensor[torch]: a 4-layer MLP cut into 2 pipeline stages, stepped by 1F1B and interleaved 1F1B
over 4 microbatches, must give the loss and every gradient of one process on the whole batch, in
float64, with the runner's P2P counts those of the plan."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import init_device_mesh
from hp_pp import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, split_layers

D, BATCH, M = 8, 8, 4


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))).double()


def main() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = mesh.get_local_rank(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, D, generator=g, dtype=torch.float64), torch.randn(BATCH, D, generator=g,
                                                                                 dtype=torch.float64)
    ref = model()
    want_loss = loss_fn(ref(x), y)
    want_loss.backward()
    for interleave in (1, 2):
        split = split_layers("auto", 4, 2, interleave)
        full = model()
        stages = [PipelineStage(nn.Sequential(*(full[i] for i in split.layers[v])), v, split.num_virtual, mesh)
                  for v in split.stages_of(rank)]
        sched = (Schedule1F1B(stages[0], M, loss_fn) if interleave == 1
                 else ScheduleInterleaved1F1B(stages, M, loss_fn))
        losses: list[torch.Tensor] = []
        last = split.num_virtual - 1 in split.stages_of(rank)
        sched.step(*([x] if rank == 0 else []), target=y if last else None, losses=losses)
        if last:
            torch.testing.assert_close(sum(losses) / M, want_loss.detach())
        for v in split.stages_of(rank):
            for i in split.layers[v]:
                for (name, p), q in zip(full[i].named_parameters(), ref[i].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, msg=lambda m, i=i, name=name: f"layer {i} {name}: {m}")
        stats = sched.last_step
        assert stats is not None
        want = M * sum((v < split.num_virtual - 1) + (v > 0) for v in split.stages_of(rank))
        assert (stats.sends, stats.recvs) == (want, want), (stats, want)
    if rank == 0:
        print("ok: 2-rank 1F1B and interleaved 1F1B pipelines match one process (loss and gradients)")
    # every rank is done with its last collective before any tears its groups down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
