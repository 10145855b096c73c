# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,no-any-return,misc,operator"
# (cases drive DTensors through torch APIs typed for plain tensors)
"""The op differential suite: every op with a sharding rule against the same op on plain tensors.

Each op names its inputs (shape and kind); a case picks one placement per mesh dim for every
input (seeded: every combination when there are few, a sample otherwise), builds the inputs as
DTensors on the mesh (``Partial`` inputs as random per-rank parts that reduce to the value) and
as plain float64 tensors on this process, runs the op on both, and compares the forward value
(``full_tensor``), and the gradient of every float input (``loss = sum(out * g)`` with ``g``
laid out like the output, so the op's backward runs on sharded gradients).  An op whose result
is a Python value must give the reference answer on every rank.  Counts come back per rank.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_RTOL, _ATOL = 1e-7, 1e-9  # float64 on both sides; Partial parts only reorder sums


@dataclass(frozen=True)
class In:
    """One input: ``kind`` is "f" (normal), "pos" (positive, away from 0), "int:N" (ids in
    [0, N)), "bool", "nan" (normal with a NaN planted), "int8" (small ints as float)."""

    shape: tuple[int, ...]
    kind: str = "f"
    grad: bool = True


@dataclass(frozen=True)
class Op:
    name: str
    fn: Callable[..., Any]
    inputs: tuple[In, ...]
    python_value: bool = False  # fn returns a Python value (bool, float)
    partial: bool = True  # float inputs may come as Partial(sum)/Partial(avg)
    max_combos: int = 10
    tags: tuple[str, ...] = field(default_factory=tuple)
    refuses: str = ""  # a documented refusal: raising with this text on every rank counts as a pass


def ops() -> list[Op]:
    import torch
    import torch.nn.functional as F

    f8 = In((4, 8))
    f48 = In((4, 8))
    pos = In((4, 8), "pos")
    m = In((8, 8))
    c0 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731  (a plain 0-d tensor)
    L: list[Op] = [
        # ---- pointwise, with constants (Partial(sum) + c adds c once)
        Op("add", torch.add, (f8, f48)),
        Op("add_broadcast", torch.add, (f8, In((8,)))),
        Op("sub", torch.sub, (f8, f48)),
        Op("mul", torch.mul, (f8, f48)),
        Op("div", torch.div, (f8, pos)),
        Op("add_scalar", lambda x: x + 1e-3, (f8,)),
        Op("sub_scalar", lambda x: x - 2.5, (f8,)),
        Op("rsub_scalar", lambda x: 1 - x, (f8,)),
        Op("add_0d_tensor", lambda x: x + c0(0.75), (f8,)),
        Op("rsub_0d_tensor", lambda x: c0(0.5) - x, (f8,)),
        Op("add_alpha", lambda x, y: torch.add(x, y, alpha=3), (f8, f48)),
        Op("scalar_div", lambda x: 2 / x, (pos,)),
        Op("div_scalar", lambda x: x / 3, (f8,)),
        Op("mul_scalar", lambda x: x * 3, (f8,)),
        Op("neg_clone", lambda x: (-x).clone(), (f8,)),
        Op("to_int", lambda x: (x * 10).to(torch.int32), (f8,)),
        Op("to_float32", lambda x: x.to(torch.float32).to(torch.float64), (f8,), tags=("f32",)),
        Op("exp_log_sqrt", lambda x: torch.exp(x / 4) + torch.log(x) + torch.sqrt(x) + torch.rsqrt(x), (pos,)),
        Op("pow", lambda x: x**2 + x.pow(3), (f8,)),
        Op("activations", lambda x: F.silu(x) + F.gelu(x) + torch.sigmoid(x) + torch.tanh(x) + F.relu(x), (f8,)),
        Op("abs_clamp", lambda x: x.abs() + x.clamp(-0.5, 0.5) + x.clamp_min(0.1), (f8,)),
        Op("maximum_minimum", lambda x, y: torch.maximum(x, y) - torch.minimum(x, y), (f8, f48)),
        Op("where", lambda x, y: torch.where(x > 0, x, y), (f8, f48)),
        Op("where_scalar", lambda x: torch.where(x > 0, x, 0.0), (f8,)),
        Op("masked_fill", lambda x, y: x.masked_fill(y > 0, 0.0), (f8, f48)),
        Op("addcmul", lambda x, y, z: torch.addcmul(x, y, z, value=0.5), (f8, f48, f48), max_combos=12),
        Op("trig_misc", lambda x: torch.sin(x) + torch.cos(x) + torch.erf(x) + F.softplus(x) + torch.expm1(x / 4),
           (f8,)),
        Op("reciprocal_square", lambda x: x.reciprocal() + x.square(), (pos,)),
        Op("compare", lambda x, y: (x > y).to(torch.float64) + (x <= 0.3).to(torch.float64), (f8, f48)),
        # ---- reductions
        Op("sum_all", lambda x: x.sum(), (f8,)),
        Op("sum_dim0", lambda x: x.sum(0), (f8,)),
        Op("sum_dims01", lambda x: x.sum(dim=(0, 1)), (f8,)),
        Op("sum_dim0_keepdim", lambda x: x.sum(0, keepdim=True), (f8,)),
        Op("sum_dim1_keepdim", lambda x: x.sum(1, True), (f8,)),
        Op("mean_all", lambda x: x.mean(), (f8,)),
        Op("mean_dim1_keepdim", lambda x: x.mean(1, keepdim=True), (f8,)),
        Op("mean_dims01", lambda x: x.mean((0, 1)), (f8,)),
        Op("amax_dim0", lambda x: x.amax(0), (f8,)),
        Op("amin_dim1_keepdim", lambda x: x.amin(1, keepdim=True), (f8,)),
        Op("amax_dims01", lambda x: x.amax((0, 1)), (f8,)),
        Op("max_all", lambda x: x.max(), (f8,)),
        Op("min_all", lambda x: x.min(), (f8,)),
        Op("max_dim", lambda x: x.max(dim=1).values, (f8,)),
        Op("min_dim0", lambda x: x.min(dim=0).values, (f8,)),
        Op("argmax", lambda x: x.argmax(0), (f8,)),
        Op("any_all", lambda x: x.any(), (In((4, 8), "bool", grad=False),)),
        Op("any_dim1", lambda x: x.any(1), (In((4, 8), "bool", grad=False),)),
        Op("all_dim0_keepdim", lambda x: x.all(0, keepdim=True), (In((4, 8), "bool", grad=False),)),
        Op("all_cmp", lambda x: (x > -1.5).all(), (f8,)),
        Op("any_dims01_cmp", lambda x: (x > 1.0).any(dim=(0, 1)), (f8,)),
        Op("all_float_dim1", lambda x: x.all(1), (f8,)),
        Op("var", lambda x: x.var(0), (f8,)),
        Op("var_keepdim", lambda x: x.var(1, keepdim=True, correction=0), (f8,)),
        Op("std", lambda x: x.std(1), (f8,)),
        Op("vector_norm", lambda x: torch.linalg.vector_norm(x), (f8,)),
        Op("vector_norm_dim1", lambda x: torch.linalg.vector_norm(x, dim=1), (f8,)),
        Op("vector_norm_ord1", lambda x: torch.linalg.vector_norm(x, ord=1, dim=0, keepdim=True), (f8,)),
        Op("vector_norm_ord3", lambda x: torch.linalg.vector_norm(x, ord=3), (f8,)),
        Op("foreach_norm", lambda x: torch._foreach_norm([x])[0], (In((4, 8), grad=False),)),
        # per-tensor reductions and products of the foreach family: not elementwise, no layout kept
        Op("foreach_max", lambda x: torch._foreach_max([x])[0], (In((4, 8), grad=False),)),
        Op("foreach_powsum", lambda x: torch._foreach_powsum([x], 3)[0], (In((4, 8), grad=False),)),
        Op("foreach_mm", lambda a, b: torch._foreach_mm([a], [b])[0], (In((4, 8), grad=False), In((8, 4), grad=False))),
        Op("vector_norm_inf", lambda x: torch.linalg.vector_norm(x, ord=float("inf")), (f8,)),
        Op("logsumexp", lambda x: torch.logsumexp(x, 1), (f8,)),
        # ---- NaN anywhere gives NaN everywhere
        Op("nan_amax", lambda x: x.amax(0), (In((4, 8), "nan"),), tags=("nan",)),
        Op("nan_max_all", lambda x: x.max(), (In((4, 8), "nan"),), tags=("nan",)),
        Op("nan_foreach_max", lambda x: torch._foreach_max([x])[0], (In((4, 8), "nan", grad=False),), tags=("nan",)),
        Op("nan_amin", lambda x: x.amin(1), (In((4, 8), "nan"),), tags=("nan",)),
        Op("nan_max_dim", lambda x: x.max(1).values, (In((4, 8), "nan"),), tags=("nan",)),
        Op("nan_sum", lambda x: x.sum(0), (In((4, 8), "nan"),), tags=("nan",)),
        Op("nan_norm", lambda x: torch.linalg.vector_norm(x), (In((4, 8), "nan"),), tags=("nan",)),
        # ---- norms, softmax, losses
        Op("softmax", lambda x: torch.softmax(x, -1), (In((4, 4, 8)),)),
        Op("log_softmax", lambda x: torch.log_softmax(x, 0), (f8,)),
        Op("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), (In((4, 4, 8)), In((8,)), In((8,)))),
        Op("rms_norm", lambda x, w: F.rms_norm(x, (8,), w, 1e-6), (In((4, 4, 8)), In((8,)))),
        Op("mse_mean", lambda x, y: F.mse_loss(x, y), (f8, f48)),
        Op("mse_sum", lambda x, y: F.mse_loss(x, y, reduction="sum"), (f8, f48)),
        Op("mse_none", lambda x, y: F.mse_loss(x, y, reduction="none"), (f8, f48)),
        Op("cross_entropy", lambda x, t: F.cross_entropy(x, t), (In((8, 12)), In((8,), "int:12"))),
        Op("cross_entropy_none", lambda x, t: F.cross_entropy(x, t, reduction="none"),
           (In((8, 12)), In((8,), "int:12"))),
        # ---- matrix products
        Op("mm", torch.mm, (In((4, 8)), In((8, 4)))),
        Op("matmul_3d", torch.matmul, (In((4, 4, 8)), In((8, 4)))),
        Op("bmm", torch.bmm, (In((4, 4, 8)), In((4, 8, 4)))),
        Op("addmm", torch.addmm, (In((4,)), In((4, 8)), In((8, 4))), max_combos=12),
        Op("linear", F.linear, (In((4, 4, 8)), In((4, 8)), In((4,))), max_combos=12),
        Op("matmul_plus_scalar", lambda x, w: (x @ w) + 1e-3, (In((4, 8)), In((8, 4)))),
        # ---- views (strides follow the local layout)
        Op("view_reshape", lambda x: x.view(2, 2, 8).reshape(4, 8).reshape(-1), (f8,)),
        Op("flatten_unflatten", lambda x: x.flatten(0, 1).unflatten(0, (4, 4)), (In((4, 4, 8)),)),
        Op("transpose_contiguous_view", lambda x: x.transpose(0, 1).contiguous().view(-1), (f8,)),
        Op("t_reshape", lambda x: x.t().reshape(-1), (f8,)),
        Op("slice_flatten", lambda x: x[:, :-1].flatten(0, 1), (In((4, 4, 8)),)),
        Op("permute", lambda x: x.permute(2, 0, 1) * 1, (In((4, 4, 8)),)),
        Op("unsqueeze_squeeze_expand", lambda x: x.unsqueeze(1).expand(4, 4, 8).sum(1).squeeze(), (f8,)),
        Op("select", lambda x: x.select(0, 1) * 2 + x[2], (In((4, 8)),)),
        Op("select_dim1", lambda x: x.select(1, 3) * 2, (In((4, 8)),)),
        Op("masked_fill_const", lambda x, y: x.masked_fill(y > 0, 1.5), (f8, f48)),
        Op("slice", lambda x: x[1:3] * 2, (f8,)),
        Op("slice_step", lambda x: x[:, 1::2] * 2, (f8,)),
        Op("split_chunk", lambda x: torch.cat([x.split([3, 5], dim=1)[1], x.chunk(2, dim=1)[0]], dim=1), (f8,)),
        Op("cat_stack", lambda x, y: torch.stack([torch.cat([x, y], 0).sum(0), y.sum(0)], 0), (f8, f48)),
        Op("unbind", lambda x: x.unbind(0)[1] * 2, (f8,)),
        # ---- indexing, scans, sorting (issue 11 class 9)
        Op("one_hot", lambda t: F.one_hot(t, 6), (In((4, 8), "int:6"),)),
        Op("embedding", lambda t, w: F.embedding(t, w), (In((4, 4), "int:8"), In((8, 8))),
           refuses="vocab-sharded embedding table on more than one mesh dim"),
        Op("repeat_interleave", lambda x: x.repeat_interleave(2, dim=1), (In((4, 4, 4, 4)),)),
        Op("index_select", lambda x, i: x.index_select(0, i), (In((4, 8)), In((4,), "int:4"))),
        Op("index_select_dim1", lambda x, i: x.index_select(1, i), (In((4, 8)), In((4,), "int:8"))),
        Op("gather", lambda x, i: x.gather(1, i), (In((4, 8)), In((4, 4), "int:8"))),
        Op("gather_dim0", lambda x, i: x.gather(0, i), (In((4, 8)), In((4, 8), "int:4"))),
        Op("cumsum", lambda x: x.cumsum(1), (f8,)),
        Op("cumsum_dim0", lambda x: x.cumsum(0), (f8,)),
        Op("flip", lambda x: x.flip(1), (f8,)),
        Op("topk", lambda x: x.topk(3, dim=1).values, (f8,)),
        Op("topk_indices", lambda x: x.topk(2, dim=0).indices, (f8,)),
        Op("sort", lambda x: x.sort(dim=1).values, (f8,)),
        Op("sort_dim0_desc", lambda x: x.sort(dim=0, descending=True).values, (f8,)),
        Op("tril", lambda x: x.tril(), (m,)),
        Op("triu_1", lambda x: x.triu(1), (m,)),
        Op("tril_neg", lambda x: x.tril(-2), (In((4, 8, 8)),)),
        Op("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           (In((2, 4, 8, 4)), In((2, 4, 8, 4)), In((2, 4, 8, 4))), partial=False, max_combos=8),
        # ---- Python values: the same global answer on every rank
        Op("equal_same", lambda x, y: torch.equal(x, x * 1), (f8, f48), python_value=True),
        Op("equal_diff", lambda x, y: torch.equal(x, y), (f8, f48), python_value=True),
        Op("allclose", lambda x, y: torch.allclose(x, x + 1e-12), (f8, f48), python_value=True),
        Op("allclose_diff", lambda x, y: torch.allclose(x, y), (f8, f48), python_value=True),
        Op("item", lambda x: x.sum().item(), (f8,), python_value=True),
        Op("bool", lambda x: bool(x.sum() > 0), (f8,), python_value=True),
        Op("is_nonzero", lambda x: x.amax().is_nonzero(), (f8,), python_value=True),
    ]
    # ---- uneven shards (torch.chunk split: the first ranks get ceil(n/k), the last may get 0).
    # Shard/Replicate only: redistributing a Partial next to an uneven shard on a 2-D mesh is
    # still wrong in the redistribute path (see the report of issue 11).
    u, u2 = In((5, 6)), In((5, 6))
    L += [
        Op("uneven_add", torch.add, (u, u2), partial=False, tags=("uneven",)),
        Op("uneven_add_scalar", lambda x: 1 - x + 1e-3, (u,), partial=False, tags=("uneven",)),
        Op("uneven_activations", lambda x: F.silu(x) * torch.sigmoid(x), (u,), partial=False, tags=("uneven",)),
        Op("uneven_sum_mean", lambda x: x.sum(0) + x.mean(0) + x.mean(), (u,), partial=False, tags=("uneven",)),
        Op("uneven_amax_var", lambda x: x.amax(1) + x.var(1), (u,), partial=False, tags=("uneven",)),
        Op("uneven_norm", lambda x: torch.linalg.vector_norm(x, dim=0), (u,), partial=False, tags=("uneven",)),
        Op("uneven_softmax", lambda x: torch.log_softmax(x, 0), (u,), partial=False, tags=("uneven",)),
        Op("uneven_mm", torch.mm, (u, In((6, 3))), partial=False, tags=("uneven",)),
        Op("uneven_linear", F.linear, (In((3, 6)), In((5, 6)), In((5,))), partial=False, tags=("uneven",)),
        Op("uneven_transpose", lambda x: x.t() * 2, (u,), partial=False, tags=("uneven",)),
        Op("uneven_view", lambda x: x.reshape(30), (u,), partial=False, tags=("uneven",)),
        Op("uneven_mse", lambda x, y: F.mse_loss(x, y), (u, u2), partial=False, tags=("uneven",)),
        Op("uneven_embedding", lambda t, w: F.embedding(t, w), (In((3, 4), "int:5"), In((5, 4))), partial=False, tags=("uneven",),
           refuses="vocab-sharded embedding table on more than one mesh dim"),
        Op("uneven_cross_entropy", lambda x, t: F.cross_entropy(x, t), (In((5, 7)), In((5,), "int:7")),
           partial=False, tags=("uneven",)),
        Op("uneven_tril", lambda x: x.tril(), (In((5, 5)),), partial=False, tags=("uneven",)),
        Op("uneven_cumsum_sort", lambda x: x.cumsum(1) + x.sort(1).values, (u,), partial=False, tags=("uneven",)),
        Op("uneven_equal", lambda x, y: torch.equal(x, x * 1) and not torch.equal(x, y), (u, u2),
           python_value=True, partial=False, tags=("uneven",)),
    ]
    return L


# ---------------------------------------------------------------------------------------------
def placement_choices(
    t: In, mesh_shape: tuple[int, ...], partial: bool, uneven: bool = False
) -> list[tuple[Any, ...]]:
    """Every placement tuple (one per mesh dim) for input ``t`` under even sharding (``uneven``:
    any split); Partials of one reduce op per tensor."""
    from hp_dtensor import Partial, Replicate, Shard

    is_float = t.kind in ("f", "pos", "nan")
    per_dim: list[list[Any]] = []
    for _ in mesh_shape:
        opts: list[Any] = [Replicate()] + [Shard(d) for d in range(len(t.shape))]
        if is_float and partial:
            opts += [Partial("sum"), Partial("avg")]
        per_dim.append(opts)
    out = []
    for combo in itertools.product(*per_dim):
        div = [1] * len(t.shape)
        ok = True
        for n, p in zip(mesh_shape, combo):
            if isinstance(p, Shard):
                div[p.dim] *= n
                ok &= t.shape[p.dim] % div[p.dim] == 0
        ops = {p.reduce_op for p in combo if isinstance(p, Partial)}
        if (ok or uneven) and len(ops) <= 1:
            out.append(combo)
    return out


def _value(t: In, gen: Any) -> Any:
    import torch

    if t.kind.startswith("int:"):
        return torch.randint(0, int(t.kind[4:]), t.shape, generator=gen)
    if t.kind == "bool":
        return torch.rand(t.shape, generator=gen) > 0.5
    x = torch.randn(t.shape, generator=gen, dtype=torch.float64)
    if t.kind == "pos":
        return x.abs() + 0.5
    if t.kind == "nan":
        x.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=gen))] = float("nan")
    return x


def _local_part(x: Any, mesh: Any, placements: tuple[Any, ...], gen: Any) -> Any:
    """This rank's part of ``x``: shards narrowed, Partials split into random parts (the same
    draw on every rank) that reduce to the value."""
    import torch

    from hp_dtensor import Partial, Shard
    from hp_dtensor.layout.shard_geometry import chunk_size_and_offset

    coord = mesh.get_coordinate()
    local = x
    for k, p in enumerate(placements):
        n = mesh.shape[k]
        if isinstance(p, Shard):
            length, start = chunk_size_and_offset(local.shape[p.dim], n, coord[k])
            local = local.narrow(p.dim, start, length)
        elif isinstance(p, Partial):
            parts = [torch.randn(local.shape, generator=gen, dtype=local.dtype) for _ in range(n - 1)]
            total = local * n if p.reduce_op == "avg" else local
            parts.append(total - sum(parts))
            local = parts[coord[k]]
    return local.contiguous()


def _close(a: Any, b: Any, tol: float) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=tol, atol=tol * (0.1 if tol > _RTOL else 1e-2), equal_nan=True))


def run_cases(rank: int, world: int, mesh_shape: tuple[int, ...], seed: int, scale: float = 1.0) -> dict[str, Any]:
    """Every op on ``mesh_shape``; returns counts and the failures (op, placements, what)."""
    import torch

    from hp_dtensor import DTensor, Partial, Replicate, init_device_mesh
    from hp_dtensor.platform.torch import dispatch

    mesh = init_device_mesh("cpu", mesh_shape)
    # The rank may have served other files' cases (pools are handed on), which fell back on purpose:
    # this run starts with no op warned and no decision cached, so each of its fallbacks decides
    # (and warns) anew; what the rank knew before is restored afterwards.
    warned_before = set(dispatch._warned)
    dispatch._warned.clear()
    dispatch._CORE.cache.clear()
    rng = random.Random(seed)
    cases = 0
    failures: list[str] = []
    covered: dict[str, int] = {}
    answers: list[Any] = []
    only = os.environ.get("HP_OP_DIFF_ONLY")
    for op in ops():
        if only and only not in op.name:
            continue
        choices = [placement_choices(t, mesh_shape, op.partial, "uneven" in op.tags) for t in op.inputs]
        combos = list(itertools.product(*choices))
        rng.shuffle(combos)
        combos = combos[: max(1, int(op.max_combos * scale))]
        for ci, combo in enumerate(combos):
            gen = torch.Generator().manual_seed(seed * 7919 + ci)
            values = [_value(t, gen) for t in op.inputs]
            ref_in = [v.clone().requires_grad_(t.grad and v.is_floating_point()) for v, t in zip(values, op.inputs)]
            d_in = []
            for v, t, pl in zip(values, op.inputs, combo):
                d = DTensor.from_local(_local_part(v, mesh, pl, gen), mesh, pl, shape=v.shape)
                d_in.append(d.detach().requires_grad_(t.grad and v.is_floating_point()))
            where = f"{op.name} {[tuple(map(str, pl)) for pl in combo]} on mesh {mesh_shape}"
            if os.environ.get("HP_OP_DIFF_TRACE"):
                print(f"rank {rank}: {where}", file=sys.stderr, flush=True)
            cases += 1
            covered[op.name] = covered.get(op.name, 0) + 1
            # A float32 cast rounds each Partial part on its own: float32 tolerances there.
            tol = 1e-5 if "f32" in op.tags else _RTOL
            try:
                out = op.fn(*d_in)
                ref = op.fn(*ref_in)
                if op.python_value:
                    answers.append((where, out))
                    if out != ref and not (isinstance(ref, float) and abs(out - ref) <= 1e-9 * max(1, abs(ref))):
                        failures.append(f"{where}: got {out!r}, reference {ref!r}")
                    continue
                full = out.full_tensor()
                if not _close(full, ref, tol):
                    failures.append(f"{where}: forward differs (max err {(full - ref).abs().nan_to_num(1e9).max()})")
                    continue
                if not ref.requires_grad:
                    continue
                g = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
                g_pl = [Replicate() if isinstance(p, Partial) else p for p in out.placements]
                (ref * g).sum().backward()
                gd = DTensor.from_local(_local_part(g, mesh, tuple(g_pl), gen), mesh, g_pl, shape=g.shape)
                (out * gd).sum().full_tensor().backward()
                for i, (r, dt) in enumerate(zip(ref_in, d_in)):
                    if r.grad is None:
                        continue
                    if dt.grad is None:
                        failures.append(f"{where}: input {i} got no gradient")
                    elif not _close(dt.grad.full_tensor(), r.grad, tol):
                        err = (dt.grad.full_tensor() - r.grad).abs().nan_to_num(1e9).max()
                        failures.append(f"{where}: input {i} gradient differs (max err {err}, "
                                        f"grad placements {dt.grad.placements})")
            except Exception as e:  # noqa: BLE001  (reported with the case; every rank raises alike)
                if op.refuses and op.refuses in str(e):
                    continue
                failures.append(f"{where}: raised {type(e).__name__}: {str(e)[:300]}")
    fallbacks = sorted(dispatch._warned)
    dispatch._warned.update(warned_before)
    return {"cases": cases, "ops": covered, "failures": failures, "fallbacks": fallbacks, "answers": answers}


def summarize(results: list[dict[str, Any]], mesh_shape: tuple[int, ...]) -> str:
    """One line a reader of the test output sees: the size of the proof."""
    r = results[0]
    return (
        f"op differential suite on mesh {mesh_shape}: {r['cases']} cases, {len(r['ops'])} ops, "
        f"{sum(len(x['failures']) for x in results)} failures, fallbacks hit: {r['fallbacks'] or 'none'}, "
        f"{len(r['answers'])} Python-value answers identical on {len(results)} ranks: "
        f"{all(x['answers'] == r['answers'] for x in results)}"
    )


def check(results: list[dict[str, Any]], mesh_shape: tuple[int, ...]) -> None:
    print(summarize(results, mesh_shape))
    failures = sorted({f for x in results for f in x["failures"]})
    assert not failures, "\n".join(failures)
    assert all(x["answers"] == results[0]["answers"] for x in results), "ranks disagree on a Python value"
    assert not results[0]["fallbacks"], f"ops fell back to replication: {results[0]['fallbacks']}"
    assert len(results[0]["ops"]) == len(ops()), "some op ran no case"
