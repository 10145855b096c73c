# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,call-overload,attr-defined,func-returns-value,arg-type,index"
"""Cross-backend parity: C1-C3 and D3 with the same weights, inputs and hp_tp plan on 2 MindSpore
ranks and on 2 torch (gloo) ranks; outputs and every local gradient agree within fp32 tolerance,
and both issue the same collectives (forward, backward and the parameter gradients' reductions).
MindSpore names LayerNorm's parameters gamma/beta where torch says weight/bias."""

from __future__ import annotations

import numpy as np
import pytest
from ms_cases import chunk, ms_block, ms_dense, ms_grads, ms_mlp, weights
from torch_cases import t_block, t_grads, t_linear, t_mlp

from hp_dtensor.testing import rank_pool_fixture

ms_pool = rank_pool_fixture(2, timeout=120, env={"HYPER_PARALLEL_PLATFORM": "mindspore"})
torch_pool = rank_pool_fixture(2, timeout=120, env={"HYPER_PARALLEL_PLATFORM": "torch"})
TOL = {"rtol": 1.5e-4, "atol": 1e-5}
_MS_NAME = {"norm.gamma": "norm.weight", "norm.beta": "norm.bias"}


def _plan(case):
    from hp_dtensor import Replicate, Shard
    from hp_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    return {
        "C1": ColwiseParallel(),
        "C2": RowwiseParallel(),
        "C3": {"up": ColwiseParallel(), "down": RowwiseParallel()},
        "D3": {
            "norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        },
    }[case]


def _inputs(case, rank, world):
    W = weights(10)
    if case == "C1":
        return W, W["x"], chunk(W["g_ffn"], -1, world, rank)
    if case == "C2":
        return W, chunk(W["x"] @ W["w1"].T, -1, world, rank), W["g_hidden"]
    if case == "C3":
        return W, W["x"], W["g_hidden"]
    return W, chunk(W["x"], 1, world, rank), chunk(W["g_hidden"], 1, world, rank)


def _run(rank, world, case, framework):
    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_tp import parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    W, x, up = _inputs(case, rank, world)
    if framework == "mindspore":
        from mindspore import Tensor

        build = {"C1": lambda: ms_dense(W["w1"], W["b1"]), "C2": lambda: ms_dense(W["w2"], W["b2"]),
                 "C3": lambda: ms_mlp(W), "D3": lambda: ms_block(W)}[case]
        module = parallelize_module(build(), mesh, _plan(case))
        with CommDebugMode() as comm:
            res = ms_grads(module, Tensor(np.ascontiguousarray(x)), Tensor(np.ascontiguousarray(up)))
        res = {("d:" + _MS_NAME[k[2:]] if k[2:] in _MS_NAME else k): v for k, v in res.items()}
        return res, comm.get_comm_counts()
    build = {"C1": lambda: t_linear(W["w1"], W["b1"]), "C2": lambda: t_linear(W["w2"], W["b2"]),
             "C3": lambda: t_mlp(W), "D3": lambda: t_block(W)}[case]
    module = parallelize_module(build(), mesh, _plan(case))
    with CommDebugMode() as comm:
        res = t_grads(module, x, up)
    return res, comm.get_comm_counts()


@pytest.mark.parametrize("case", ["C1", "C2", "C3", "D3"])
def test_same_outputs_and_gradients_on_torch_and_mindspore(case, ms_pool, torch_pool):
    ms_res = ms_pool.run(_run, case, "mindspore")
    torch_res = torch_pool.run(_run, case, "torch")
    for rank, ((m, m_counts), (t, t_counts)) in enumerate(zip(ms_res, torch_res)):
        assert m_counts == t_counts, (case, m_counts, t_counts)
        assert set(m) == set(t), (sorted(m), sorted(t))
        for key in sorted(t):
            np.testing.assert_allclose(m[key], t[key], err_msg=f"{case} rank {rank} {key}", **TOL)
