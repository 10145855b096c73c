# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,call-overload,union-attr"
"""loss_parallel on 2 MindSpore ranks: ``ops.cross_entropy`` / ``nn.CrossEntropyLoss`` on logits
sharded over the vocab equal torch's ``F.cross_entropy`` in float64 on one process -- loss and the
logits' gradient -- for every combination of weight, ignore_index, reduction, label_smoothing and
logits shape ((N, C), (N, C, d) and (C,)), without gathering the vocab; bad arguments raise the
same error on every rank."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool = rank_pool_fixture(2, timeout=240, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
VOCAB = 10
IGNORE = -100
TOL = {"rtol": 1.5e-4, "atol": 1e-5}

SHAPES = [(6, VOCAB), (3, VOCAB, 4), (VOCAB,)]
CASES = list(itertools.product(range(len(SHAPES)), (False, True), (0.0, 0.1), ("mean", "sum", "none")))


def _data(case_id: int):
    shape_id, use_weight, smoothing, reduction = CASES[case_id]
    shape = SHAPES[shape_id]
    rs = np.random.RandomState(100 + case_id)
    logits = (rs.randn(*shape) * 2).astype(np.float32)
    tshape = tuple(s for d, s in enumerate(shape) if d != (0 if len(shape) == 1 else 1))
    target = np.asarray(rs.randint(0, VOCAB, size=tshape), np.int32)
    if target.size > 1:
        target.reshape(-1)[rs.rand(target.size) < 0.3] = IGNORE  # some rows ignored
    weight = (rs.rand(VOCAB) + 0.5).astype(np.float32) if use_weight else None
    upstream = np.asarray(rs.randn(*tshape), np.float32) if reduction == "none" else None
    return shape, logits, target, weight, smoothing, reduction, upstream


def _reference(case_id: int):
    import torch
    import torch.nn.functional as F

    shape, logits, target, weight, smoothing, reduction, upstream = _data(case_id)
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    w = None if weight is None else torch.tensor(weight, dtype=torch.float64)
    loss = F.cross_entropy(x, torch.tensor(target, dtype=torch.long), weight=w, ignore_index=IGNORE,
                           reduction=reduction, label_smoothing=smoothing)
    (loss if upstream is None else (loss * torch.tensor(upstream, dtype=torch.float64)).sum()).backward()
    return loss.detach().numpy(), x.grad.numpy()


def _loss_fn(mesh, class_dim, api, t, w, reduction, smoothing, upstream):
    from mindspore import nn, ops

    from hp_dtensor import DTensor, Shard

    def loss_fn(x_local):
        x = DTensor.from_local(x_local, mesh, [Shard(class_dim)])
        if api == "nn":
            loss = nn.CrossEntropyLoss(weight=w, ignore_index=IGNORE, reduction=reduction,
                                       label_smoothing=smoothing)(x, t)
        else:
            loss = ops.cross_entropy(x, t, w, IGNORE, reduction, smoothing)
        plain = loss.to_local()
        return (plain if upstream is None else (plain * upstream).sum()), plain

    return loss_fn


def _ms_cases(rank: int, world: int, case_ids: list[int], api: str):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import CommDebugMode, init_device_mesh, loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for case_id in case_ids:
        shape, logits, target, weight, smoothing, reduction, upstream = _data(case_id)
        class_dim = 0 if len(shape) == 1 else 1
        local = np.ascontiguousarray(np.split(logits, world, axis=class_dim)[rank])

        loss_fn = _loss_fn(mesh, class_dim, api, Tensor(target), None if weight is None else Tensor(weight),
                           reduction, smoothing, None if upstream is None else Tensor(upstream))
        with loss_parallel(), CommDebugMode() as comm:
            (_, loss), grad = ms.value_and_grad(loss_fn, 0, has_aux=True)(Tensor(local))
        out.append((loss.asnumpy(), grad.asnumpy(), comm.get_comm_counts()))
    return out


@pytest.mark.parametrize("api", ["ops", "nn"])
def test_vocab_parallel_cross_entropy_matches_torch_float64(pool: RankPool, api: str) -> None:
    ids = list(range(len(CASES))) if api == "ops" else [0, 7, 13, 22]
    res = pool.run(_ms_cases, ids, api)
    for pos, case_id in enumerate(ids):
        ref_loss, ref_grad = _reference(case_id)
        class_dim = 0 if len(SHAPES[CASES[case_id][0]]) == 1 else 1
        for rank in range(2):
            loss, grad, counts = res[rank][pos]
            np.testing.assert_allclose(loss, ref_loss, err_msg=f"case {CASES[case_id]} rank {rank}", **TOL)
            np.testing.assert_allclose(grad, np.split(ref_grad, 2, axis=class_dim)[rank],
                                       err_msg=f"case {CASES[case_id]} rank {rank} grad", **TOL)
            # Never a gather of the vocab: forward reduces the row max, the sum of exp, the picked
            # targets (and the smoothing term); backward reduces the sum of exp's gradient.
            assert counts == {"all_reduce": 4 + (CASES[case_id][2] > 0)}, (CASES[case_id], counts)
    print(f"{api}: {len(ids)} generated cases x 2 ranks checked against torch float64")


def _bad(rank: int, world: int, what: str) -> str:
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Shard, init_device_mesh, loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = DTensor.from_local(Tensor(np.ones((4, VOCAB // world), np.float32)), mesh, [Shard(1)])
    t = Tensor(np.array([1, 2, 3, 4], np.int32))
    args = {
        "reduction": lambda: ops.cross_entropy(x, t, None, IGNORE, "avg"),
        "smoothing": lambda: ops.cross_entropy(x, t, None, IGNORE, "mean", 1.5),
        "shape": lambda: ops.cross_entropy(x, Tensor(np.array([1, 2], np.int32))),
        "range": lambda: ops.cross_entropy(x, Tensor(np.array([1, 2, 3, VOCAB], np.int32))),
        "weight": lambda: ops.cross_entropy(x, t, Tensor(np.ones(3, np.float32))),
        "probs": lambda: ops.cross_entropy(x, Tensor(np.ones((4, VOCAB), np.float32))),
    }[what]
    try:
        with loss_parallel():
            args()
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("what,error", [
    ("reduction", "ValueError: cross_entropy: reduction must be one of"),
    ("smoothing", "ValueError: cross_entropy: label_smoothing must be in [0, 1]"),
    ("shape", "ValueError: cross_entropy: target shape (2,)"),
    ("range", "ValueError: cross_entropy: target holds class indices outside [0, 10)"),
    ("weight", "ValueError: cross_entropy: weight must have shape (10,)"),
    ("probs", "NotImplementedError: loss_parallel supports class-index targets only"),
])
def test_bad_arguments_raise_on_every_rank(pool: RankPool, what: str, error: str) -> None:
    for msg in pool.run(_bad, what):
        assert msg.startswith(error), msg


def _restored(rank: int, world: int) -> bool:
    from mindspore import mint, ops

    from hp_dtensor import loss_parallel

    before = (ops.cross_entropy, mint.nn.functional.cross_entropy)
    with loss_parallel(), loss_parallel():
        inside = ops.cross_entropy is not before[0]
    return inside and (ops.cross_entropy, mint.nn.functional.cross_entropy) == before


def test_context_restores_mindspore_functions(pool: RankPool) -> None:
    assert pool.run(_restored) == [True, True]
