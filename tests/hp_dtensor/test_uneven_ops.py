# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Ops on unevenly sharded DTensors (4 gloo ranks): values and input gradients equal plain
float64 tensors on one process; rules that assume equal shards get their input redistributed
first, so nothing computes on mismatched shards."""

from __future__ import annotations

from typing import Any

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool4 = rank_pool_fixture(4, timeout=120)

OPS = (
    "add_scalar", "mul", "add_bias", "zeros_like_add", "inplace_add", "foreach_add", "sum_dim", "sum_all",
    "mean_dim", "amax_dim", "matmul", "linear", "softmax", "view", "rms_norm", "sum_row", "mean_row_keep",
    "amax_row_keep", "row_scale",
)
# pointwise ops keep the uneven shards and compute locally: no collective
LOCAL = {"add_scalar", "mul", "add_bias", "zeros_like_add", "inplace_add", "foreach_add"}
# per-row statistics (a reduction over the columns, then broadcast back): local too when only the
# rows are sharded -- an RMSNorm over the hidden dim of a sequence-sharded activation
LOCAL_IF_ROWS = {"rms_norm", "sum_row", "mean_row_keep", "amax_row_keep", "row_scale"}


def _apply(name: str, x: Any, w: Any) -> Any:
    import torch

    if name == "add_scalar":
        return x + 0.5
    if name == "mul":
        return x * x
    if name == "add_bias":
        return x + w[:, 0]  # a replicated (cols,) bias broadcast over the rows
    if name == "zeros_like_add":
        return torch.zeros_like(x) + x
    if name == "inplace_add":
        y = x * 1.0
        y.add_(x, alpha=0.5)
        return y
    if name == "foreach_add":
        y = x * 1.0
        torch._foreach_add_([y], [x])
        return y
    if name == "sum_dim":
        return x.sum(1)
    if name == "sum_all":
        return x.sum()
    if name == "mean_dim":
        return x.mean(0)
    if name == "amax_dim":
        return x.amax(0)
    if name == "rms_norm":
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1.0 + w[:, 0])
    if name == "sum_row":
        return x.sum(-1)
    if name == "mean_row_keep":
        return x.mean(-1, keepdim=True)
    if name == "amax_row_keep":
        return x.amax(-1, keepdim=True)
    if name == "row_scale":
        return x * x.sum(-1, keepdim=True)
    if name == "matmul":
        return x @ w
    if name == "linear":
        return torch.nn.functional.linear(x, w.t())
    if name == "softmax":
        return torch.softmax(x, 0)
    return x.reshape(-1)


def _uneven_ops(rank: int, world: int) -> list[tuple[str, Any, Any, bool, bool]]:
    import torch

    from hp_dtensor import CommDebugMode, Replicate, Shard, distribute_tensor, init_device_mesh

    out = []
    for mesh_shape, pl in (((4,), [Shard(0)]), ((4,), [Shard(1)]), ((2, 2), [Shard(0), Shard(0)]), ((2, 2), [Shard(1), Shard(0)])):
        mesh = init_device_mesh("cpu", mesh_shape)
        for rows, cols in ((5, 3), (6, 2), (1, 2)):
            for name in OPS:
                g = torch.Generator().manual_seed(rows * 100 + cols)
                xg = torch.randn(rows, cols, generator=g, dtype=torch.float64)
                wg = torch.randn(cols, 4, generator=g, dtype=torch.float64)
                ref_x = xg.clone().requires_grad_(True)
                ref = _apply(name, ref_x, wg)
                ref.sum().backward() if ref.ndim == 0 else (ref * torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).reshape(ref.shape)).sum().backward()
                x = distribute_tensor(xg.clone(), mesh, pl).requires_grad_(True)
                w = distribute_tensor(wg, mesh, [Replicate()] * len(mesh_shape))
                try:
                    with CommDebugMode() as comm:
                        y = _apply(name, x, w)
                    rows_only = all(p.dim == 0 for p in pl)
                    if (name in LOCAL or (name in LOCAL_IF_ROWS and rows_only)) and comm.get_total_counts():
                        raise AssertionError(f"pointwise op communicated: {comm.get_comm_counts()}")
                    full = y.full_tensor()
                    weight = torch.linspace(-1, 1, full.numel(), dtype=torch.float64).reshape(full.shape)
                    (full.sum() if full.ndim == 0 else (full * weight).sum()).backward()
                    ok_val = tuple(y.shape) == tuple(ref.shape) and torch.allclose(full, ref.detach(), rtol=1e-12, atol=1e-12)
                    ok_grad = torch.allclose(x.grad.full_tensor(), ref_x.grad, rtol=1e-12, atol=1e-12)
                    out.append((f"{mesh_shape} {pl} ({rows},{cols}) {name}", tuple(y.shape), tuple(ref.shape), bool(ok_val), bool(ok_grad)))
                except Exception as e:  # a clear refusal is allowed, a wrong number is not
                    out.append((f"{mesh_shape} {pl} ({rows},{cols}) {name}", "raised", f"{type(e).__name__}: {e}"[:200], True, True))
    return out


def test_ops_on_uneven_shards_match_one_process(pool4: RankPool, capsys: Any) -> None:
    results = pool4.run(_uneven_ops)
    bad = [r for per_rank in results for r in per_rank if not (r[3] and r[4])]
    raised = [r for r in results[0] if r[1] == "raised"]
    with capsys.disabled():
        print(f"\nops on uneven shards: {len(results[0])} cases x 4 ranks, {len(bad)} wrong, {len(raised)} refused")
        for r in raised[:10]:
            print("   refused:", r[0], r[2])
    assert not bad, bad[:5]
    assert not raised, raised[:5]


def _uneven_strides(rank: int, world: int) -> list[tuple[str, Any, Any]]:
    import torch

    from hp_dtensor import Shard, distribute_tensor, init_device_mesh

    out = []
    for mesh_shape, pl in (((4,), [Shard(1)]), ((4,), [Shard(0)]), ((2, 2), [Shard(2), Shard(1)])):
        mesh = init_device_mesh("cpu", mesh_shape)
        for shape in ((3, 5), (2, 5, 1), (2, 3, 5), (5, 1, 3), (1, 2, 3)):
            if any(p.dim >= len(shape) for p in pl):
                continue
            plain = torch.randn(shape, dtype=torch.float64)
            x = distribute_tensor(plain, mesh, pl)
            for name, fn in (("x", lambda t: t), ("mul", lambda t: t * 2), ("add", lambda t: t + t),
                             ("zeros_like", torch.zeros_like), ("clone", lambda t: t.clone()),
                             ("contiguous", lambda t: t.contiguous()), ("to_f32", lambda t: t.float()),
                             ("gelu", torch.nn.functional.gelu), ("detach", lambda t: t.detach())):
                got, want = fn(x), fn(plain)
                out.append((f"{mesh_shape} {pl} {shape} {name}",
                            (tuple(got.stride()), got.is_contiguous()), (tuple(want.stride()), want.is_contiguous())))
    return out


def test_uneven_shards_report_the_plain_tensors_strides_on_every_rank(pool4: RankPool) -> None:
    """Strides from each rank's own shard would differ across ranks (a size-1 or empty shard takes
    any stride), and composite ops and autograd choose paths by strides: every rank must report the
    plain tensor's strides."""
    results = pool4.run(_uneven_strides)
    for per_rank in results:
        assert per_rank == results[0]
        wrong = [r for r in per_rank if r[1] != r[2]]
        assert not wrong, wrong[:5]
    print(f"\nuneven strides: {len(results[0])} cases x 4 ranks agree with plain tensors")
