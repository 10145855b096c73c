# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The Qwen3.5 TP plan under ``torch.inference_mode()`` (evaluation and serving) on 2 gloo ranks,
with and without sequence parallel and loss parallel: logits and loss equal ``no_grad`` exactly and
the unsharded model on one process, with the same collectives as ``no_grad``; the model still
trains afterwards with the unsharded model's gradients."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=240)

RTOL, ATOL = 1.5e-4, 1e-5


def _inference(rank: int, world: int, sp: bool, lp: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_models.qwen3_5 import parallelize_qwen3_5_tp, tiny_config
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = tiny_config(chunk_size=8)
    torch.manual_seed(0)
    ref = cfg.build()
    ref.init_weights()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = parallelize_qwen3_5_tp(copy.deepcopy(ref), mesh, sequence_parallel=sp, loss_parallel=lp)
    gen = torch.Generator().manual_seed(1)

    def loss_of(logits: Any, tgt: Any) -> Any:
        if lp:
            with loss_parallel():
                return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        return F.cross_entropy(logits.to_local().flatten(0, 1), tgt.flatten())

    def run(ids: Any, tgt: Any) -> tuple[Any, Any, dict[str, int]]:
        with CommDebugMode() as comm:
            logits = model(ids)
            loss = loss_of(logits, tgt)
            full = logits.full_tensor()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return full, loss, comm.get_comm_counts()

    counts = {}
    for _ in range(2):  # the second call meets whatever the first cached
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        tgt = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        with torch.no_grad():
            ref_logits = ref(ids)
            ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), tgt.flatten())
            ng_logits, ng_loss, counts["no_grad"] = run(ids, tgt)
        with torch.inference_mode():
            inf_logits, inf_loss, counts["inference"] = run(ids.clone(), tgt.clone())
        torch.testing.assert_close(ng_logits, ref_logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ng_loss, ref_loss, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(inf_logits, ng_logits, rtol=0, atol=0)
        torch.testing.assert_close(inf_loss, ng_loss, rtol=0, atol=0)
    # training after evaluation: nothing made under inference mode is saved for backward
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten()).backward()
    logits = model(ids)
    if lp:
        with loss_parallel():
            loss_of(logits, tgt).backward()
    else:
        loss_of(logits, tgt).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    return counts


@pytest.mark.parametrize("sp,lp", [(True, True), (False, False)], ids=["sp_lossparallel", "no_sp"])
def test_tp_plan_under_inference_mode_equals_no_grad_and_unsharded(pool2: RankPool, sp: bool, lp: bool) -> None:
    for counts in pool2.run(_inference, sp, lp, timeout=240):
        assert counts["inference"] == counts["no_grad"], counts
