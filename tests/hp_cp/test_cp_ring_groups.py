# mypy: disable-error-code="no-untyped-def"
"""The ring's own process groups belong to c10d: after ``destroy_process_group`` nothing keeps them
(alive, their gloo threads would run into interpreter exit), and a second default group in the
same process gets fresh ones; ring attention equals SDPA on the whole sequence in both."""

from __future__ import annotations

from hp_dtensor.testing import run_rank_scripts

_SCRIPT = """
import gc, sys, weakref
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hp_cp import ContextParallel, ContextParallelConfig
from hp_dtensor import init_device_mesh
from hp_dtensor.platform.torch.process_group import init_rank

rank, root = int(sys.argv[1]), sys.argv[2]
for world in ("first", "second"):
    init_rank(None, f"{root}/{world}", rank, 2, 60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    cp = ContextParallel(mesh, ContextParallelConfig(degree=2))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = cp.attention(*(cp.split(x, dim=2) for x in (q, k, v)), seq_len=8)
    torch.testing.assert_close(out, cp.split(want, dim=2))
    ring = weakref.ref(cp._ring_group)
    del cp
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    print(rank, world, "ring group released:", ring() is None)
"""


def test_ring_groups_released_and_fresh_per_default_group(tmp_path) -> None:
    outs = run_rank_scripts(_SCRIPT, 2, str(tmp_path))
    for r, out in enumerate(outs):
        assert out.splitlines() == [f"{r} first ring group released: True",
                                    f"{r} second ring group released: True"], out
