# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,call-overload,attr-defined,func-returns-value,arg-type,index"
"""Test-matrix row E (docs/tensor-parallel.md), MindSpore rows, on 2 CPU ranks launched as MindSpore does
(a scheduler and two workers with the MS_* variables): A6, B1/B2, C1-C3, C6, C8, PrepareModule*
with a kwargs pre-hook and a multi-output forward hook, and D3.  Numbers are checked against a
single-process MindSpore reference with the same weights (fp32 rtol=1.5e-4, atol=1e-5); gradients
of sharded weights are compared shard by shard, without dividing by tp_size (our all_reduce's
dual is the identity, as in Megatron and torch).  The ranks start once for the module.
"""

from __future__ import annotations

import numpy as np
import pytest
from ms_cases import (
    FFN,
    VOCAB,
    H,
    chunk,
    ms_block,
    ms_dense,
    ms_embedding,
    ms_grads,
    ms_layer_norm,
    ms_mlp,
    weights,
)

from hp_dtensor.testing import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=120, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}


def _mesh():
    from hp_dtensor import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _t(a):
    from mindspore import Tensor

    return Tensor(np.ascontiguousarray(a))


# ------------------------------------------------------------------ rank functions
def _colwise(rank, world):
    from hp_dtensor import Shard
    from hp_tp import ColwiseParallel, parallelize_module

    W = weights(1)
    cell = parallelize_module(ms_dense(W["w1"], W["b1"]), _mesh(), ColwiseParallel())
    geometry = (cell.weight.placements == (Shard(0),), tuple(cell.weight.to_local().shape),
                cell.bias.placements == (Shard(0),), tuple(cell.bias.to_local().shape))
    res = ms_grads(cell, _t(W["x"]), _t(chunk(W["g_ffn"], -1, world, rank)))
    return geometry, res


def _rowwise(rank, world):
    from hp_dtensor import Replicate, Shard
    from hp_tp import RowwiseParallel, parallelize_module

    W = weights(2)
    cell = parallelize_module(ms_dense(W["w2"], W["b2"]), _mesh(), RowwiseParallel())
    geometry = (cell.weight.placements == (Shard(1),), tuple(cell.weight.to_local().shape),
                cell.bias.placements == (Replicate(),), tuple(cell.bias.to_local().shape))
    res = ms_grads(cell, _t(chunk(W["x"] @ W["w1"].T, -1, world, rank)), _t(W["g_hidden"]))
    return geometry, res


def _mlp(rank, world):
    from hp_dtensor import CommDebugMode
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    W = weights(3)
    cell = parallelize_module(ms_mlp(W), _mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with CommDebugMode() as comm:
        res = ms_grads(cell, _t(W["x"]), _t(W["g_hidden"]))
    return res, comm.get_comm_counts()


def _embedding(rank, world, style):
    """C4 (table split by columns, output Shard(-1)) and C5 (split by vocab rows: a masked lookup
    whose partial sums are all-reduced) with the table's gradient; ids stay integers."""
    from mindspore import Tensor

    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    W = weights(12)
    st = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    cell = parallelize_module(ms_embedding(W["emb"]), _mesh(), st)
    up = chunk(W["g_hidden"], -1, world, rank) if style == "colwise" else W["g_hidden"]
    res = ms_grads(cell, Tensor(W["ids"]), _t(up), input_grad=False)
    return cell.embedding_table.placements, tuple(cell.embedding_table.to_local().shape), res


def _sequence_parallel(rank, world):
    from hp_dtensor import Replicate
    from hp_tp import SequenceParallel, parallelize_module

    W = weights(4)
    cell = parallelize_module(ms_layer_norm(W["ln_w"], W["ln_b"]), _mesh(), SequenceParallel())
    rep = cell.gamma.placements == (Replicate(),) and tuple(cell.gamma.to_local().shape) == (H,)
    res = ms_grads(cell, _t(chunk(W["x"], 1, world, rank)), _t(chunk(W["g_hidden"], 1, world, rank)))
    return rep, res


def _no_parallel(rank, world):
    from hp_dtensor import Replicate
    from hp_tp import NoParallel, parallelize_module

    W = weights(5)
    cell = parallelize_module(ms_dense(W["w2"], W["b2"]), _mesh(), NoParallel())
    rep = cell.weight.placements == (Replicate(),) and cell.bias.placements == (Replicate(),)
    return rep, ms_grads(cell, _t(W["x"] @ W["w1"].T), _t(W["g_hidden"]))


def _more_compositions(rank, world):
    """C7: SequenceParallel on Dropout(p=0) is the identity on the shard.  C9: a sequence-sharded
    activation gathered into a NoParallel Dense.  C10: PrepareModuleInput(Shard(0) -> Replicate)
    in front of a Colwise Dense.  C11: Rowwise Dense whose output PrepareModuleOutput re-shards."""
    from mindspore import nn

    from hp_dtensor import Replicate, Shard
    from hp_tp import (
        ColwiseParallel,
        NoParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    W = weights(13)
    mesh = _mesh()
    x_seq = _t(chunk(W["x"], 1, world, rank))
    drop = parallelize_module(nn.Dropout(p=0.0), mesh, SequenceParallel())
    c7 = drop(x_seq).to_local().asnumpy()

    class Wrap(nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, x):
            return self.inner(x)

    c9_cell = parallelize_module(Wrap(ms_dense(W["w2"][:, :H], W["b2"])), mesh, {
        "inner": NoParallel(input_layout=Shard(1), desired_input_layout=Replicate())})
    c9 = c9_cell(x_seq).asnumpy()

    c10_cell = parallelize_module(Wrap(ms_dense(W["w1"], W["b1"])), mesh, {"inner": ColwiseParallel()})
    c10_cell = parallelize_module(c10_cell, mesh, PrepareModuleInput(
        input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)))
    c10 = c10_cell(_t(chunk(W["x"], 0, world, rank))).asnumpy()

    row = parallelize_module(ms_dense(W["w2"], W["b2"]), mesh, RowwiseParallel(use_local_output=False))
    row = parallelize_module(row, mesh, PrepareModuleOutput(output_layouts=(Replicate(),),
                                                            desired_output_layouts=(Shard(1),)))
    c11 = row(_t(chunk(W["x"] @ W["w1"].T, -1, world, rank))).asnumpy()
    return c7, c9, c10, c11


def _prepare_kwargs(rank, world):
    """PrepareModuleInput with a kwargs pre-hook: positional and keyword inputs both gathered."""
    from mindspore import nn

    from hp_dtensor import Replicate, Shard
    from hp_tp import PrepareModuleInput, parallelize_module

    class TwoInputs(nn.Cell):
        def construct(self, x, scale=None):
            self.seen = (tuple(x.shape), tuple(scale.shape))
            return x * 2.0 + scale

    W = weights(6)
    cell = parallelize_module(TwoInputs(), _mesh(), PrepareModuleInput(
        input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
        input_kwarg_layouts={"scale": Shard(0)}, desired_input_kwarg_layouts={"scale": Replicate()},
        use_local_output=True,
    ))
    out = cell(_t(chunk(W["x"], 0, world, rank)), scale=_t(chunk(W["g_hidden"], 0, world, rank)))
    return cell.seen, out.asnumpy()


def _prepare_multi_output(rank, world):
    """PrepareModuleOutput on a two-output forward: the first output is gathered, the second
    (layout None) comes back untouched."""
    from mindspore import nn

    from hp_dtensor import Replicate, Shard
    from hp_tp import PrepareModuleOutput, parallelize_module

    class TwoOutputs(nn.Cell):
        def construct(self, x):
            return x * 3.0, x + 1.0

    W = weights(7)
    cell = parallelize_module(TwoOutputs(), _mesh(), PrepareModuleOutput(
        output_layouts=(Shard(1), None), desired_output_layouts=(Replicate(), None)))
    a, b = cell(_t(chunk(W["x"], 1, world, rank)))
    return a.asnumpy(), b.asnumpy(), type(b).__name__


def _d3_block(rank, world):
    from hp_dtensor import CommDebugMode, Replicate, Shard
    from hp_tp import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    W = weights(8)
    cell = parallelize_module(ms_block(W), _mesh(), {
        "norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    with CommDebugMode() as comm:
        res = ms_grads(cell, _t(chunk(W["x"], 1, world, rank)), _t(chunk(W["g_hidden"], 1, world, rank)))
    return res, comm.get_comm_counts()


def _train(cell, x, upstream, optimizer, steps=3):
    """A few optimizer steps on loss = sum(out * upstream); returns the losses and the weights."""
    import mindspore as ms

    params = cell.trainable_params()
    if optimizer == "adam":
        opt = ms.nn.Adam(params, 0.05)
    else:  # a hand-written SGD: AssignSub of each parameter with its (local) gradient
        def opt(grads):
            for p, g in zip(params, grads):
                ms.ops.assign_sub(p, g * 0.1)

    def loss_fn(inp):
        y = cell(inp)
        return ((y.to_local() if hasattr(y, "placements") else y) * upstream).sum()

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(x)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    weights = {n: (p.to_local() if hasattr(p, "placements") else p).asnumpy() for n, p in cell.parameters_and_names()}
    return losses, weights


def _mlp_training(rank, world, optimizer):
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    W = weights(9)
    cell = parallelize_module(ms_mlp(W), _mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return _train(cell, _t(W["x"]), _t(W["g_hidden"]), optimizer)


# ------------------------------------------------------------------ references (one process)
def _reference(cell, x, upstream):
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    return ms_grads(cell, _t(x), _t(upstream))


def _cat(results, key, dim):
    return np.concatenate([r[key] for r in results], axis=dim)


# ------------------------------------------------------------------ tests
def test_B1_C1_colwise_linear(pool):
    out = pool.run(_colwise)
    W = weights(1)
    for geometry, _ in out:
        assert geometry == (True, (FFN // 2, H), True, (FFN // 2,))
    res = [r for _, r in out]
    ref = _reference(ms_dense(W["w1"], W["b1"]), W["x"], W["g_ffn"])
    np.testing.assert_allclose(_cat(res, "out", -1), ref["out"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:weight", 0), ref["d:weight"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:bias", 0), ref["d:bias"], **TOL)
    for r in res:  # the replicated input's gradient is whole on every rank
        np.testing.assert_allclose(r["dx"], ref["dx"], **TOL)


def test_B2_C2_rowwise_linear(pool):
    out = pool.run(_rowwise)
    W = weights(2)
    for geometry, _ in out:
        assert geometry == (True, (H, FFN // 2), True, (H,))
    res = [r for _, r in out]
    ref = _reference(ms_dense(W["w2"], W["b2"]), W["x"] @ W["w1"].T, W["g_hidden"])
    for r in res:
        np.testing.assert_allclose(r["out"], ref["out"], **TOL)
        np.testing.assert_allclose(r["d:bias"], ref["d:bias"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:weight", 1), ref["d:weight"], **TOL)
    np.testing.assert_allclose(_cat(res, "dx", -1), ref["dx"], **TOL)


def test_C3_colwise_rowwise_mlp(pool):
    out = pool.run(_mlp)
    W = weights(3)
    res = [r for r, _ in out]
    ref = _reference(ms_mlp(W), W["x"], W["g_hidden"])
    for r in res:
        np.testing.assert_allclose(r["out"], ref["out"], **TOL)
        np.testing.assert_allclose(r["dx"], ref["dx"], **TOL)
        np.testing.assert_allclose(r["d:down.bias"], ref["d:down.bias"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:up.weight", 0), ref["d:up.weight"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:up.bias", 0), ref["d:up.bias"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:down.weight", 1), ref["d:down.weight"], **TOL)
    # Megatron's pattern: one all_reduce forward (row output), one backward (column input).
    assert out[0][1] == {"all_reduce": 2}


@pytest.mark.parametrize("optimizer", ["adam", "assign_sub"])
def test_C3_mlp_trains_like_one_process(pool, optimizer):
    """Three optimizer steps on the TP MLP: MindSpore's nn.Adam (its kernel runs on the local
    shards) and a hand-written SGD (AssignSub of a DTensor parameter with its plain local gradient,
    through __fallback__) both follow the single-process run step for step."""
    out = pool.run(_mlp_training, optimizer)
    W = weights(9)
    ref_losses, ref_w = _train(ms_mlp(W), _t(W["x"]), _t(W["g_hidden"]), optimizer)
    for losses, _ in out:
        np.testing.assert_allclose(losses, ref_losses, **TOL)
    ws = [w for _, w in out]
    np.testing.assert_allclose(_cat(ws, "up.weight", 0), ref_w["up.weight"], **TOL)
    np.testing.assert_allclose(_cat(ws, "up.bias", 0), ref_w["up.bias"], **TOL)
    np.testing.assert_allclose(_cat(ws, "down.weight", 1), ref_w["down.weight"], **TOL)
    for w in ws:
        np.testing.assert_allclose(w["down.bias"], ref_w["down.bias"], **TOL)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_C4_C5_embedding(pool, style):
    from mindspore import Tensor

    from hp_dtensor import Shard

    out = pool.run(_embedding, style)
    W = weights(12)
    ref = ms_grads(ms_embedding(W["emb"]), Tensor(W["ids"]), _t(W["g_hidden"]), input_grad=False)
    res = [r for _, _, r in out]
    if style == "colwise":  # B3 and C4
        assert all(pl == (Shard(1),) and shape == (VOCAB, H // 2) for pl, shape, _ in out)
        np.testing.assert_allclose(_cat(res, "out", -1), ref["out"], **TOL)
        np.testing.assert_allclose(_cat(res, "d:embedding_table", 1), ref["d:embedding_table"], **TOL)
    else:  # B4 and C5
        assert all(pl == (Shard(0),) and shape == (VOCAB // 2, H) for pl, shape, _ in out)
        for r in res:
            np.testing.assert_allclose(r["out"], ref["out"], **TOL)
        np.testing.assert_allclose(_cat(res, "d:embedding_table", 0), ref["d:embedding_table"], **TOL)


def test_C6_sequence_parallel_layer_norm(pool):
    out = pool.run(_sequence_parallel)
    W = weights(4)
    assert all(rep for rep, _ in out)
    res = [r for _, r in out]
    ref = _reference(ms_layer_norm(W["ln_w"], W["ln_b"]), W["x"], W["g_hidden"])
    np.testing.assert_allclose(_cat(res, "out", 1), ref["out"], **TOL)
    np.testing.assert_allclose(_cat(res, "dx", 1), ref["dx"], **TOL)
    for r in res:  # replicated norm weights: the same whole gradient on every rank
        np.testing.assert_allclose(r["d:gamma"], ref["d:gamma"], **TOL)
        np.testing.assert_allclose(r["d:beta"], ref["d:beta"], **TOL)


def test_C8_no_parallel_linear(pool):
    out = pool.run(_no_parallel)
    W = weights(5)
    ref = _reference(ms_dense(W["w2"], W["b2"]), W["x"] @ W["w1"].T, W["g_hidden"])
    for rep, r in out:
        assert rep
        for key in ("out", "dx", "d:weight", "d:bias"):
            np.testing.assert_allclose(r[key], ref[key], **TOL)


def test_C7_C9_C10_C11_compositions(pool):
    W = weights(13)
    out = pool.run(_more_compositions)
    full_c9 = W["x"] @ W["w2"][:, :H].T + W["b2"]
    full_c10 = W["x"] @ W["w1"].T + W["b1"]
    full_c11 = (W["x"] @ W["w1"].T) @ W["w2"].T + W["b2"]
    for rank, (c7, c9, c10, c11) in enumerate(out):
        np.testing.assert_allclose(c7, chunk(W["x"], 1, 2, rank), **TOL)
        np.testing.assert_allclose(c9, full_c9, **TOL)
        np.testing.assert_allclose(c10, chunk(full_c10, -1, 2, rank), **TOL)
        np.testing.assert_allclose(c11, chunk(full_c11, 1, 2, rank), **TOL)


def test_prepare_module_input_kwargs_pre_hook(pool):
    out = pool.run(_prepare_kwargs)
    W = weights(6)
    for seen, value in out:
        assert seen == (W["x"].shape, W["g_hidden"].shape)
        np.testing.assert_allclose(value, W["x"] * 2.0 + W["g_hidden"], **TOL)


def test_prepare_module_output_multi_output_hook(pool):
    out = pool.run(_prepare_multi_output)
    W = weights(7)
    for rank, (a, b, b_type) in enumerate(out):
        np.testing.assert_allclose(a, W["x"] * 3.0, **TOL)
        np.testing.assert_allclose(b, chunk(W["x"], 1, 2, rank) + 1.0, **TOL)
        assert b_type == "Tensor"


def test_D3_qwen_minimal_block(pool):
    out = pool.run(_d3_block)
    W = weights(8)
    res = [r for r, _ in out]
    ref = _reference(ms_block(W), W["x"], W["g_hidden"])
    np.testing.assert_allclose(_cat(res, "out", 1), ref["out"], **TOL)
    np.testing.assert_allclose(_cat(res, "dx", 1), ref["dx"], **TOL)
    for name in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(_cat(res, f"d:attn.{name}.weight", 0), ref[f"d:attn.{name}.weight"], **TOL)
    np.testing.assert_allclose(_cat(res, "d:attn.o_proj.weight", 1), ref["d:attn.o_proj.weight"], **TOL)
    for r in res:
        for key in ("d:attn.o_proj.bias", "d:norm.gamma", "d:norm.beta"):
            np.testing.assert_allclose(r[key], ref[key], **TOL)
    # Forward: all_gather into attention, reduce_scatter out of o_proj.  Backward: o_proj's dual
    # all_gather; one reduce_scatter for the gathered input, whose three column-parallel layers'
    # gradient terms are summed before it (torch's count); all_reduce of the norm's gamma and beta.
    assert out[0][1] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
