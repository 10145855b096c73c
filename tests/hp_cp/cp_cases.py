# mypy: disable-error-code="no-untyped-def,no-any-return"
"""Rank functions for the context-parallel tests: the attention kernel of every method against
plain SDPA on the whole sequence in one process, with the collectives counted."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hp_cp import ContextParallel, ContextParallelConfig, CPMethod, MaskCompression, document_ids
from hp_dtensor import CommDebugMode, init_device_mesh


@dataclass(frozen=True)
class AttnCase:
    cp: int
    method: CPMethod
    ulysses: int | None
    dtype: str
    eod: bool
    batch: int
    heads: int
    kv_heads: int
    chunk: int
    head_dim: int
    async_comm: bool
    seed: int

    @property
    def seq(self) -> int:
        return 2 * self.cp * self.chunk


def generate_cases(n: int, seed: int, methods: tuple[CPMethod, ...], world: int) -> list[AttnCase]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        method = methods[i % len(methods)]
        if method is CPMethod.HYBRID:
            cp, u = 4, 2
        else:
            cp, u = rng.choice([2, world]), None
        if method is CPMethod.ULYSSES:
            u = cp
        step = u or 1
        heads = step * rng.choice([1, 3, 5]) if step > 1 else rng.choice([1, 3, 5, 7])
        kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
        out.append(AttnCase(
            cp=cp, method=method, ulysses=u, dtype=rng.choice(["float64", "float32"]), eod=rng.random() < 0.5,
            batch=rng.choice([1, 2]), heads=heads, kv_heads=kv_heads, chunk=rng.choice([1, 2, 3, 5]),
            head_dim=rng.choice([4, 8]), async_comm=rng.random() < 0.5, seed=rng.randrange(1 << 30),
        ))
    return out


def random_documents(rng: random.Random, seq: int) -> list[int]:
    """Cumulative document ends: between 1 and 4 documents of random lengths."""
    cuts = sorted(rng.sample(range(1, seq), min(seq - 1, rng.randint(0, 3))))
    return [*cuts, seq]


def cp_mesh(world: int, case_cp: int, method: CPMethod, u: int | None):
    if method is CPMethod.HYBRID:
        assert u is not None
        return init_device_mesh("cpu", (case_cp // u, u), mesh_dim_names=("cp_ring", "cp_ulysses"))
    if case_cp == world:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return init_device_mesh("cpu", (world // case_cp, case_cp), mesh_dim_names=("dp", "cp"))["cp"]


def reference(q, k, v, dout, doc_rows):
    """Plain SDPA over the whole sequence (causal, within documents), outputs and input grads."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if doc_rows is not None:
        doc = torch.tensor(doc_rows)
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def run_attention_case(rank: int, world: int, case: AttnCase) -> dict:
    dtype = getattr(torch, case.dtype)
    mesh = cp_mesh(world, case.cp, case.method, case.ulysses)
    config = ContextParallelConfig(
        degree=case.cp, method=case.method, ulysses_degree=case.ulysses, async_comm=case.async_comm,
        compression=MaskCompression.EOD if case.eod else MaskCompression.CAUSAL,
    )
    cp = ContextParallel(mesh, config)
    g = torch.Generator().manual_seed(case.seed)
    b, h, hkv, s, d = case.batch, case.heads, case.kv_heads, case.seq, case.head_dim
    q = torch.randn(b, h, s, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    dout = torch.randn(b, h, s, d, generator=g, dtype=dtype)
    rng = random.Random(case.seed)
    actual = [random_documents(rng, s) for _ in range(b)] if case.eod else None
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, [document_ids(a, s) for a in actual] if actual else None)

    lq, lk, lv = (cp.split(x, dim=2).detach().requires_grad_(True) for x in (q, k, v))
    with CommDebugMode() as fwd:
        out = cp.attention(lq, lk, lv, seq_len=s, actual_seq_len=actual)
    with CommDebugMode() as bwd:
        out.backward(cp.split(dout, dim=2))
    errs = {}
    for name, got, want in (("out", out, ref_out), ("dq", lq.grad, ref_dq), ("dk", lk.grad, ref_dk),
                            ("dv", lv.grad, ref_dv)):
        want = cp.split(want, dim=2)
        errs[name] = float(((got.detach() - want).abs() / (want.abs() + 1.0)).max())
    return {
        "errs": errs, "fwd": fwd.get_comm_counts(), "bwd": bwd.get_comm_counts(),
        "fwd_log": fwd.comm_log, "dtype": case.dtype,
    }


def run_attention_case_unfused(rank: int, world: int, case: AttnCase) -> dict:
    """``run_attention_case`` with every block computed by explicit matmuls, the path devices
    without a fused flash kernel that returns the log-sum-exp take."""
    from hp_cp.platform.torch import ring

    fused = ring._FUSED_DEVICES
    ring._FUSED_DEVICES = frozenset()
    try:
        return run_attention_case(rank, world, case)
    finally:
        ring._FUSED_DEVICES = fused


def run_bad_input(rank: int, world: int, what: str) -> tuple[str, str]:
    """Build the misuse ``what`` and return the (exception type, message) it raised here."""
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        if what == "seq_len":
            cp = ContextParallel(mesh, ContextParallelConfig(degree=world))
            cp.split(torch.zeros(1, 6 * world + 2), dim=1)
        elif what == "ulysses_heads":
            cp = ContextParallel(mesh, ContextParallelConfig(degree=world, method=CPMethod.ULYSSES))
            x = torch.zeros(1, world + 1, 2, 4)
            cp.attention(x, x, x, seq_len=2 * world)
        elif what == "hybrid_degree":
            ContextParallel(mesh, ContextParallelConfig(degree=world, method=CPMethod.HYBRID, ulysses_degree=3))
        elif what == "no_compression":
            ContextParallel(mesh, ContextParallelConfig(degree=world, compression=MaskCompression.NONE))
        elif what == "mask_full":
            ContextParallel(mesh, ContextParallelConfig(degree=world, mask_type="full"))
        elif what == "method_name":
            CPMethod.parse("stripes")
        else:
            raise AssertionError(what)
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e)
    return "none", ""


def run_largest_tensor(rank: int, world: int, seq: int) -> dict:
    """The largest tensor any op produces during a ring attention forward and backward at
    cp = world, and the bool tensors' largest (a mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel = 0
            self.mask = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
                    if t.dtype == torch.bool:
                        self.mask = max(self.mask, t.numel())
            return out

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = ContextParallel(mesh, ContextParallelConfig(degree=world, compression=MaskCompression.EOD))
    g = torch.Generator().manual_seed(5)
    q, k, v = (cp.split(torch.randn(1, 1, seq, 4, generator=g), dim=2).requires_grad_(True) for _ in range(3))
    with Largest() as mode:
        out = cp.attention(q, k, v, seq_len=seq, actual_seq_len=[[seq // 3, seq]])
        out.sum().backward()
    return {"numel": mode.numel, "mask": mode.mask}


def run_against_torch_ring(rank: int, world: int, case_cp: int, batch: int, heads: int, chunk: int, head_dim: int,
                           seed: int) -> dict:
    """Causal ring attention at ``case_cp`` against torch's own context-parallel ring
    (``torch.distributed.tensor.experimental``): its ``context_parallel`` cannot run SDPA on a CPU
    (the error is returned), so torch's ring template runs directly with the CPU flash-attention
    kernels, on the same load-balanced split (rank r holds chunks r and 2cp-1-r), fp64 and no
    fp32 up-cast.  Outputs and input gradients of both, and both against plain SDPA."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    mesh = cp_mesh(world, case_cp, CPMethod.COLOSSAL, None)
    cp = ContextParallel(mesh, ContextParallelConfig(degree=case_cp))
    g = torch.Generator().manual_seed(seed)
    s = 2 * case_cp * chunk
    q, k, v, dout = (torch.randn(batch, heads, s, head_dim, generator=g, dtype=torch.float64) for _ in range(4))
    ref = reference(q, k, v, dout, None)

    # torch's public entry point first: on a CPU it has no sharding rule for the CPU SDPA kernel
    torch_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // case_cp, case_cp),
                                                                 mesh_dim_names=("dp", "cp"))["cp"]
    public_error = ""
    try:
        with context_parallel(torch_mesh, buffers=[q.clone(), k.clone(), v.clone()], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the test prints it
        public_error = f"{type(e).__name__}: {e}"

    lq, lk, lv, ldout = (cp.split(x, dim=2) for x in (q, k, v, dout))
    group = torch_mesh.get_group()
    old = torch_cp._cp_options.convert_to_f32
    torch_cp._cp_options.convert_to_f32 = False
    try:
        t_out, t_lse = torch_cp._templated_ring_attention(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, lq, lk, lv,
            is_causal=True, dropout_p=0.0, scale=None)[:2]
        t_dq, t_dk, t_dv = torch_cp._templated_ring_attention_backward(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=ldout, grad_out_name="grad_out", query=lq, key=lk, value=lv, out=t_out, logsumexp=t_lse,
            is_causal=True, dropout_p=0.0, scale=None)[:3]
    finally:
        torch_cp._cp_options.convert_to_f32 = old

    mq, mk, mv = (x.detach().clone().requires_grad_(True) for x in (lq, lk, lv))
    out = cp.attention(mq, mk, mv, seq_len=s)
    out.backward(ldout)

    def rel(a, b) -> float:
        return float(((a.detach() - b.detach()).abs() / (b.detach().abs() + 1.0)).max())

    ours = {"out": out, "dq": mq.grad, "dk": mk.grad, "dv": mv.grad}
    theirs = {"out": t_out, "dq": t_dq, "dk": t_dk, "dv": t_dv}
    full = dict(zip(("out", "dq", "dk", "dv"), (cp.split(x, dim=2) for x in ref)))
    return {
        "public_error": public_error,
        "ours_vs_torch": {n: rel(ours[n], theirs[n]) for n in ours},
        "torch_vs_sdpa": {n: rel(theirs[n], full[n]) for n in ours},
        "ours_vs_sdpa": {n: rel(ours[n], full[n]) for n in ours},
    }


def run_ring_beside_p2p(rank: int, world: int, seed: int) -> dict:
    """Ring attention at cp = world while another component's point-to-point message is in flight
    on the default group with the ring's own tag (a pipeline stage waiting for activations): the
    ring runs on its own process group, so neither takes the other's message."""
    import torch.distributed as dist

    mesh = cp_mesh(world, world, CPMethod.COLOSSAL, None)
    cp = ContextParallel(mesh, ContextParallelConfig(degree=world))
    g = torch.Generator().manual_seed(seed)
    s = 2 * world * 3
    q, k, v, dout = (torch.randn(1, 2, s, 4, generator=g, dtype=torch.float64) for _ in range(4))
    ref = reference(q, k, v, dout, None)
    inbox = torch.zeros(3, dtype=torch.float64)
    pending = dist.irecv(inbox, (rank - 1) % world, tag=7100)  # posted before the ring runs
    lq, lk, lv = (cp.split(x, dim=2).requires_grad_(True) for x in (q, k, v))
    out = cp.attention(lq, lk, lv, seq_len=s)
    out.backward(cp.split(dout, dim=2))
    dist.send(torch.full((3,), float(rank), dtype=torch.float64), (rank + 1) % world, tag=7100)
    assert pending is not None
    pending.wait()
    errs = {n: float((got.detach() - cp.split(want, dim=2)).abs().max())
            for n, got, want in zip(("out", "dq", "dk", "dv"), (out, lq.grad, lk.grad, lv.grad), ref)}
    return {"errs": errs, "inbox": inbox.tolist(), "expected": [float((rank - 1) % world)] * 3}


def run_reduce_loss_uneven(rank: int, world: int, case_cp: int, seed: int) -> dict:
    """``reduce_loss`` with a different number of counted tokens on every rank (some none): the
    mean over the whole sequence and its gradient, against one process."""
    mesh = cp_mesh(world, case_cp, CPMethod.COLOSSAL, None)
    cp = ContextParallel(mesh, ContextParallelConfig(degree=case_cp))
    g = torch.Generator().manual_seed(seed)
    s = 2 * case_cp * 4
    losses = torch.rand(2, s, generator=g, dtype=torch.float64)
    keep = torch.rand(2, s, generator=g) < 0.6
    n = s // (2 * case_cp)
    keep[:, :n] = False  # CP rank 0's chunks (the first and the last) count no token at all
    keep[:, s - n:] = False
    ref_x = losses.clone().requires_grad_(True)
    ref = (ref_x * keep).sum() / keep.sum()
    ref.backward()
    x = cp.split(losses, dim=1).requires_grad_(True)
    mine = cp.split(keep, dim=1)
    loss = cp.reduce_loss((x * mine).sum(), mine.sum().to(x.dtype))
    loss.backward()
    return {"count": int(mine.sum()), "err": abs(loss.item() - ref.item()),
            "grad_err": float((x.grad - cp.split(ref_x.grad, dim=1)).abs().max())}
