# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,call-overload,union-attr"
"""loss_parallel on 2 MindSpore ranks: ``ops.cross_entropy`` / ``nn.CrossEntropyLoss`` on logits
sharded over the vocab equal torch's ``F.cross_entropy`` in float64 on one process -- loss and the
logits' gradient -- for every combination of target kind (class index, class probabilities),
weight, ignore_index, reduction, label_smoothing and logits shape ((N, C), (N, C, d) and (C,)),
also with the vocab on the second dim of a 2-D mesh, without gathering the vocab: two all_reduces
in all, none in backward.  Bad arguments raise torch's error on every rank."""

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
CASES = list(itertools.product(range(len(SHAPES)), (False, True), (0.0, 0.1), ("mean", "sum", "none"),
                               ("index", "probs")))


def _data(case_id: int):
    shape_id, use_weight, smoothing, reduction, kind = CASES[case_id]
    shape = SHAPES[shape_id]
    rs = np.random.RandomState(100 + case_id)
    logits = (rs.randn(*shape) * 2).astype(np.float32)
    tshape = tuple(s for d, s in enumerate(shape) if d != (0 if len(shape) == 1 else 1))
    if kind == "probs":
        target = rs.rand(*shape).astype(np.float32)
        target /= target.sum(axis=0 if len(shape) == 1 else 1, keepdims=True)
    else:
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
    t = torch.tensor(target, dtype=torch.float64 if target.dtype == np.float32 else torch.long)
    loss = F.cross_entropy(x, t, weight=w, ignore_index=IGNORE,
                           reduction=reduction, label_smoothing=smoothing)
    (loss if upstream is None else (loss * torch.tensor(upstream, dtype=torch.float64)).sum()).backward()
    return loss.detach().numpy(), x.grad.numpy()


def _loss_fn(mesh, class_dim, api, t, w, reduction, smoothing, upstream):
    from mindspore import nn, ops

    from hp_dtensor import DTensor, Replicate, Shard

    def loss_fn(x_local):
        x = DTensor.from_local(x_local, mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(class_dim)])
        if api == "nn":
            loss = nn.CrossEntropyLoss(weight=w, ignore_index=IGNORE, reduction=reduction,
                                       label_smoothing=smoothing)(x, t)
        else:
            loss = ops.cross_entropy(x, t, w, IGNORE, reduction, smoothing)
        plain = loss.to_local()
        return (plain if upstream is None else (plain * upstream).sum()), plain

    return loss_fn


def _ms_cases(rank: int, world: int, case_ids: list[int], api: str, mesh_2d: bool = False):
    import mindspore as ms
    from mindspore import Tensor

    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_tp import loss_parallel

    if mesh_2d:  # the vocab on the second mesh dim, the first (of size 1) replicating
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    else:
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


@pytest.mark.parametrize("api", ["ops", "nn", "ops-2d-mesh"])
def test_vocab_parallel_cross_entropy_matches_torch_float64(pool: RankPool, api: str) -> None:
    ids = list(range(len(CASES))) if api == "ops" else [0, 7, 13, 22, 45, 70]
    res = pool.run(_ms_cases, ids, api.split("-")[0], api.endswith("2d-mesh"))
    for pos, case_id in enumerate(ids):
        ref_loss, ref_grad = _reference(case_id)
        class_dim = 0 if len(SHAPES[CASES[case_id][0]]) == 1 else 1
        for rank in range(2):
            loss, grad, counts = res[rank][pos]
            np.testing.assert_allclose(loss, ref_loss, err_msg=f"case {CASES[case_id]} rank {rank}", **TOL)
            np.testing.assert_allclose(grad, np.split(ref_grad, 2, axis=class_dim)[rank],
                                       err_msg=f"case {CASES[case_id]} rank {rank} grad", **TOL)
            # Never a gather of the vocab: forward reduces the row max, then the row sums stacked in
            # one tensor; backward is local.
            assert counts == {"all_reduce": 2}, (CASES[case_id], counts)
    print(f"{api}: {len(ids)} generated cases x 2 ranks checked against torch float64")


BAD = {  # bad call -> the same arguments to torch on one process (None: not torch's own error)
    "reduction": ((4, VOCAB), [1, 2, 3, 4], None, {"reduction": "avg"}),
    "smoothing": ((4, VOCAB), [1, 2, 3, 4], None, {"label_smoothing": 1.5}),
    "shape": ((4, VOCAB), [1, 2], None, {}),
    "range": ((4, VOCAB), [1, 2, 3, VOCAB], None, {}),
    "negative": ((4, VOCAB), [1, -5, 3, 4], None, {}),
    "weight": ((4, VOCAB), [1, 2, 3, 4], 3, {}),
}


def _bad(rank: int, world: int, what: str) -> str:
    from mindspore import Tensor, ops

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh
    from hp_tp import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if what == "layout":  # replicated logits: loss_parallel would silently compute unsplit
        x = DTensor.from_local(Tensor(np.ones((4, VOCAB), np.float32)), mesh, [Replicate()])
        call = lambda: ops.cross_entropy(x, Tensor(np.array([1, 2, 3, 4], np.int32)))  # noqa: E731
    elif what == "target-type":
        x = DTensor.from_local(Tensor(np.ones((4, VOCAB // world), np.float32)), mesh, [Shard(1)])
        call = lambda: ops.cross_entropy(x, [1, 2, 3, 4])  # noqa: E731
    else:
        shape, target, weight, kw = BAD[what]
        x = DTensor.from_local(Tensor(np.ones((4, VOCAB // world), np.float32)), mesh, [Shard(1)])
        w = None if weight is None else Tensor(np.ones(weight, np.float32))
        call = lambda: ops.cross_entropy(  # noqa: E731
            x, Tensor(np.array(target, np.int32)), w, IGNORE, kw.get("reduction", "mean"),
            kw.get("label_smoothing", 0.0))
    try:
        with loss_parallel():
            call()
    except Exception as e:  # noqa: BLE001  (the type is part of what is checked)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _torch_error(what: str) -> str:
    import torch
    import torch.nn.functional as F

    shape, target, weight, kw = BAD[what]
    w = None if weight is None else torch.ones(weight)
    with pytest.raises(Exception) as info:  # noqa: PT011
        F.cross_entropy(torch.ones(shape), torch.tensor(target), weight=w, **kw)
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("what", [*BAD, "layout", "target-type"])
def test_bad_arguments_raise_torchs_error_on_every_rank(pool: RankPool, what: str) -> None:
    msgs = pool.run(_bad, what)
    assert msgs[0] == msgs[1], msgs
    if what == "layout":
        assert msgs[0].startswith("ValueError: loss_parallel: cross_entropy needs logits sharded on the class dim")
    elif what == "target-type":
        assert msgs[0] == "TypeError: loss_parallel: cross_entropy expects tensor target/weight, got list"
    else:
        assert msgs[0] == _torch_error(what)


def _restored(rank: int, world: int) -> bool:
    from mindspore import mint, ops

    from hp_tp import loss_parallel

    before = (ops.cross_entropy, mint.nn.functional.cross_entropy)
    with loss_parallel(), loss_parallel():
        inside = ops.cross_entropy is not before[0]
    return inside and (ops.cross_entropy, mint.nn.functional.cross_entropy) == before


def test_context_restores_mindspore_functions(pool: RankPool) -> None:
    assert pool.run(_restored) == [True, True]
