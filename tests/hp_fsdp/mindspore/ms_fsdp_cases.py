# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,var-annotated,assignment,call-arg,misc,union-attr"
"""A small transformer-like MindSpore Cell and one training routine for the fully_shard tests.

``run_case(rank, world, cfg)`` builds the same model (seeded weights, float32) on every rank and a
one-process copy, shards it as ``cfg`` says (FSDP over a 1-D mesh, HSDP over a 2-D one), trains
``steps`` AdamW steps (written out in numpy, elementwise, so a shard steps exactly like its rows
of the whole tensor) on this rank's slice of one global batch and returns: the worst relative
differences of gradients and parameters against the one-process run, the losses, the collectives
of each step and the bytes this rank holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

RTOL, ATOL = 1.5e-4, 1e-5
GROUPS = 4  # fully_shard groups of Net when nested: three blocks and the root
BATCH = 8


def check_numbers(results) -> None:
    """Every rank's gradients and parameters within fp32 tolerance (rtol 1.5e-4, atol 1e-5) of one
    process, and the mean of the ranks' losses equal to the one-process loss."""
    for r in results:
        assert r["names_match"]
        assert r["worst"]["grad"] <= 1.0, r["worst"]
        assert r["worst"]["param"] <= 1.0, r["worst"]
        assert r["leftover"] == [], r["leftover"]
    n = len(results)
    for step, ref in enumerate(results[0]["ref_losses"]):
        ours = sum(r["losses"][step] for r in results) / n
        assert abs(ours - ref) <= 1e-6 + 1.5e-4 * abs(ref), (step, ours, ref)


def check_clip(results, max_norm: float) -> None:
    """Every rank's total norm of every step equal to one process's (rtol 1e-5) and above
    ``max_norm`` (so the clipping scaled the gradients), with ``check_numbers``' gradients (the
    clipped ones) and parameters."""
    check_numbers(results)
    ref = results[0]["ref_norms"]
    assert len(ref) == 3 and all(n > max_norm for n in ref), ref
    for r in results:
        for a, b in zip(r["norms"], ref, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r["norms"], ref)


def build(blocks: int = 3):
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self, d: int, h: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm((d,))
            self.up = nn.Dense(d, h)
            self.down = nn.Dense(h, d)

        def construct(self, x):
            return x + self.down(ops.tanh(self.up(self.norm(x))))

    class Net(nn.Cell):
        """Uneven by design: no dim 0 divides by 4 (out.weight has 3 rows: 4 ranks get 1, 1, 1, 0)."""

        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Dense(5, 10)
            self.blocks = nn.CellList([Block(10, 6) for _ in range(blocks)])
            self.out = nn.Dense(10, 3)

        def construct(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    net = Net()
    rng = np.random.RandomState(0)
    for _name, p in sorted(net.parameters_and_names(), key=lambda kv: kv[0]):
        p.set_data(ms.Tensor((rng.randn(*p.shape) * 0.3).astype(np.float32)))
    return net


def data():
    rng = np.random.RandomState(1)
    return rng.randn(BATCH, 5).astype(np.float32), rng.randn(BATCH, 3).astype(np.float32)


class AdamW:
    """AdamW on numpy arrays keyed by parameter name (elementwise)."""

    def __init__(self, lr: float = 0.05, wd: float = 0.01) -> None:
        self.lr, self.wd, self.t = lr, wd, 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.t += 1
        out = {}
        for k, p in params.items():
            g = grads[k].astype(np.float64)
            m = self.m.get(k, np.zeros_like(g)) * 0.9 + 0.1 * g
            v = self.v.get(k, np.zeros_like(g)) * 0.999 + 0.001 * g * g
            self.m[k], self.v[k] = m, v
            mh, vh = m / (1 - 0.9**self.t), v / (1 - 0.999**self.t)
            out[k] = (p * (1 - self.lr * self.wd) - self.lr * mh / (np.sqrt(vh) + 1e-8)).astype(np.float32)
        return out

    def state_bytes(self) -> int:
        return sum(a.size * 4 for a in self.m.values()) + sum(a.size * 4 for a in self.v.values())


def _local(p) -> np.ndarray:
    from mindspore import Tensor

    return Tensor._make_subclass(Tensor, p).asnumpy() if type(p) is not Tensor else p.asnumpy()


def _set_local(p, value: np.ndarray) -> None:
    import mindspore as ms

    ms.Parameter.set_data(p, ms.Tensor(value))


def _train(net, x, y, steps: int, accum: int, on_step=None, sync=None, clip=None, norms=None):
    """``steps`` AdamW steps; each sums ``accum`` micro-batch gradients (mean loss per micro-batch,
    divided by ``accum``).  Returns losses and the gradients of the last step by parameter name.
    ``clip=(max_norm, norm_type)`` (``accum`` 1): the gradients go through ``hp_fsdp.clip_grads``
    (with the parameters, for their layouts) and each step's total norm is appended to ``norms``."""
    import mindspore as ms
    from mindspore import ops

    weights = net.trainable_params()
    names = [p.name for p in weights]

    def loss_fn(xb, yb):
        return ops.mean((net(xb) - yb) ** 2) / accum

    grad_fn = ms.value_and_grad(loss_fn, None, weights)
    opt = AdamW()
    losses, last = [], {}
    micro = np.array_split(np.arange(len(x)), accum)
    for step in range(steps):
        if on_step:
            on_step(step, "start")
        total, acc = 0.0, None
        for k, idx in enumerate(micro):
            if sync:
                sync(k == accum - 1)
            loss, grads = grad_fn(ms.Tensor(x[idx]), ms.Tensor(y[idx]))
            if clip is not None:
                from hp_fsdp import clip_grads

                grads, norm = clip_grads(grads, clip[0], clip[1], parameters=weights)
                norms.append(float(norm.asnumpy()))
            total += float(loss.asnumpy())
            g_np = [_local(g) for g in grads]
            acc = g_np if acc is None else [a + b for a, b in zip(acc, g_np)]
        if on_step:
            on_step(step, "end")
        last = dict(zip(names, acc))
        new = opt.step({n: _local(p) for n, p in zip(names, weights)}, last)
        for n, p in zip(names, weights):
            _set_local(p, new[n])
        losses.append(total)
    return losses, last, {n: _local(p) for n, p in zip(names, weights)}, opt


def _rows(full: np.ndarray, n: int, r: int) -> np.ndarray:
    """torch.chunk-style rows of dim 0 owned by shard rank ``r`` of ``n``."""
    rows = -(-full.shape[0] // n)
    return full[r * rows: min(full.shape[0], (r + 1) * rows)]


def _worst(ours: np.ndarray, ref: np.ndarray, rtol: float = RTOL, atol: float = ATOL) -> float:
    """Largest |a-b| / (atol + rtol |b|): at most 1 means within tolerance."""
    if ours.size == 0:
        return 0.0
    return float(np.max(np.abs(ours - ref) / (atol + rtol * np.abs(ref))))


def run_case(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """FSDP (``mesh`` 1-D) or HSDP (2-D ``(replicate, shard)``) against one process."""
    from hp_dtensor import CommDebugMode, init_device_mesh
    from hp_fsdp import fully_shard

    mesh_shape = tuple(cfg["mesh"])
    # The mesh first: MindSpore refuses to join a job once a kernel has run in the process.
    tp = bool(cfg.get("tp"))
    full_mesh = None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp") if tp else None)
    steps, accum = cfg.get("steps", 3), cfg.get("accum", 1)
    x, y = data()
    ref = build()
    clip = cfg.get("clip")
    ref_norms, norms = [], []
    ref_losses, ref_grads, ref_params, _ = _train(ref, x, y, steps, accum, clip=clip, norms=ref_norms)

    net = build()
    full_bytes = sum(int(np.prod(p.shape)) * 4 for p in net.trainable_params())
    if tp:  # TP inside each block (up colwise, down rowwise), then FSDP over dp on top
        from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

        for b in net.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        full_mesh, mesh = mesh, mesh["dp"]
    kw = {}
    if cfg.get("mp") == "fp16":  # gather and compute in float16, reduce in float32 (fp32 masters)
        import mindspore as ms

        from hp_fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=ms.float16, reduce_dtype=ms.float32)
    if cfg.get("nested", True):
        for b in net.blocks:
            fully_shard(b, mesh=mesh, **kw)
    if kw:  # the root's output in float32 for the loss (a block's would meet the root's float16 head)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=ms.float16, reduce_dtype=ms.float32,
                                               output_dtype=ms.float32)
    fully_shard(net, mesh=mesh, **kw)
    dp_rank = mesh.get_coordinate()
    shard_n, shard_r = mesh.shape[-1], dp_rank[-1]
    dp_index = dp_rank[0] * mesh.shape[-1] + dp_rank[-1] if mesh.ndim == 2 else dp_rank[0]
    # each data-parallel rank's slice of the global batch (TP ranks of one dp rank share it)
    rows = np.array_split(np.arange(BATCH), mesh.size())[dp_index]
    tp_r = full_mesh.get_local_rank(1) if tp else 0

    def expected(name: str, full: np.ndarray) -> np.ndarray:
        if tp and ".up." in name:
            full = np.split(full, 2, axis=0)[tp_r]
        elif tp and name.endswith("down.weight"):
            full = np.split(full, 2, axis=1)[tp_r]
        return _rows(full, shard_n, shard_r)

    comms: list[dict[str, int]] = []
    comm_bytes: list[dict[str, int]] = []
    mode: list[Any] = []

    def on_step(step: int, when: str) -> None:
        if when == "start":
            mode.append(CommDebugMode().__enter__())
        else:
            m = mode.pop()
            m.__exit__(None, None, None)
            comms.append(m.get_comm_counts())
            comm_bytes.append(m.get_comm_bytes())

    sync = (lambda on: net.set_requires_gradient_sync(on)) if accum > 1 else None
    losses, grads, params, opt = _train(net, x[rows], y[rows], steps, accum, on_step, sync, clip, norms)
    worst = {"grad": 0.0, "param": 0.0}
    tol = cfg.get("tol", (RTOL, ATOL))
    for name, g in grads.items():
        worst["grad"] = max(worst["grad"], _worst(g, expected(name, ref_grads[name]), *tol))
        worst["param"] = max(worst["param"], _worst(params[name], expected(name, ref_params[name]), *tol))
    leftover = [name for _p, cell in net.cells_and_names() for name in ("weight", "bias", "gamma", "beta")
                if name in cell.__dict__]  # gathered values still shown to a cell after the step
    return {
        "names_match": sorted(grads) == sorted(ref_grads), "worst": worst, "losses": losses,
        "ref_losses": ref_losses, "comms": comms, "comm_bytes": comm_bytes,
        "dtypes": sorted({str(p.dtype) for p in net.trainable_params()}), "leftover": leftover,
        "param_bytes": sum(a.size * 4 for a in params.values()), "grad_bytes": sum(a.size * 4 for a in grads.values()),
        "opt_bytes": opt.state_bytes(), "full_bytes": full_bytes, "norms": norms, "ref_norms": ref_norms,
    }
