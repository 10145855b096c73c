"""The trainer's optimizer is torch's foreach AdamW and steps exactly as the for-loop AdamW.

The foreach implementation is what makes a DTensor model's optimizer step one dispatch per op
rather than one per parameter; it must not change a number.  On one process, the tiny model with
weight decay, the job's betas and a learning rate that changes every step: parameters and both
moments are bit for bit those of ``torch.optim.AdamW(foreach=False)`` after every step.  (On
DTensors, foreach optimizer steps are compared with plain tensors in hp_dtensor's test_ops.)"""

from __future__ import annotations

import copy


def test_trainer_adamw_is_foreach_and_equals_the_for_loop_bit_for_bit() -> None:
    import torch
    import torch.nn.functional as F

    from hp_models import synthetic
    from hp_models.job import OptimSettings
    from hp_models.qwen3_5 import tiny_config
    from hp_models.trainer.optimizer import build_optimizer, set_lr

    cfg = tiny_config()
    torch.manual_seed(0)
    ours = cfg.build()
    ours.init_weights()
    loop = copy.deepcopy(ours)
    settings = OptimSettings(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    opt = build_optimizer(ours, settings)
    ref = torch.optim.AdamW(loop.parameters(), lr=settings.lr, betas=settings.betas, eps=settings.eps,
                            weight_decay=settings.weight_decay, foreach=False)
    assert opt.defaults["foreach"] is True
    compared = 0
    for step, lr in enumerate([3e-3, 2e-3, 5e-4, 1e-3]):
        ids, tgt = synthetic.batch(0, step, 4, 16, cfg.vocab_size)
        for model, o in ((ours, opt), (loop, ref)):
            set_lr(o, lr)
            F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()
            o.step()
            o.zero_grad()
        for p, q in zip(ours.parameters(), loop.parameters(), strict=True):
            assert torch.equal(p, q), (step, p.shape)
            assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
            compared += 1
    print(f"\nforeach AdamW = for-loop AdamW, bit for bit: {compared} parameter-steps")
