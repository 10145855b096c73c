"""``get_total_norm`` and ``clip_grads`` on MindSpore, one process, against numpy in float64,
through both routes of the partial norms (numpy on the CPU target, MindSpore ops elsewhere).

Generated cases (seeded, counted in the output): lists of gradients of random shapes (0-d,
empty, uneven), each float dtype (bfloat16 included), every norm type ``clip_grad_norm_`` takes
(2, 1, 0, 3.5, inf, -inf), some with NaN or inf entries.  The total norm equals numpy's norm of the
values (float64, in the widest dtype of the list), and the clipped gradients equal
``g * min(max_norm / (norm + 1e-6), 1)`` in their own dtype."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from hp_fsdp import clip_grads, get_total_norm
from hp_fsdp.platform.mindspore import grad_norm as grad_norm_module

DTYPES = [(ms.float32, np.float32), (ms.float16, np.float16), (ms.float64, np.float64), (ms.bfloat16, None)]
NORMS = [2.0, 1.0, 0.0, 3.5, math.inf, -math.inf]


def _values(t: Tensor) -> np.ndarray:
    return (t.astype(ms.float32) if t.dtype == ms.bfloat16 else t).asnumpy().astype(np.float64)


def _numpy_norm(arrays: list[np.ndarray], p: float) -> float:
    """torch's total norm: the ``p``-norm of the per-tensor ``p``-norms (so for ``p == 0`` the
    number of tensors with a nonzero entry); an empty tensor's norm is the identity of ``p``."""
    norms = []
    for a in arrays:
        a = np.abs(a).reshape(-1)
        if a.size == 0:
            norms.append(math.inf if p == -math.inf else 0.0)
        elif p == math.inf:
            norms.append(a.max())
        elif p == -math.inf:
            norms.append(a.min())
        elif p == 0:
            norms.append(float(np.count_nonzero(a)))
        else:
            norms.append((a**p).sum() ** (1.0 / p))
    v = np.array(norms)
    if p == math.inf:
        return float(v.max())
    if p == -math.inf:
        return float(v.min())
    if p == 0:
        return float(np.count_nonzero(v))
    return float((v**p).sum() ** (1.0 / p))


@pytest.mark.parametrize("target", ["CPU", "Ascend"])
def test_total_norm_and_clip_equal_numpy(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The partial norms are taken by numpy where the gradients are in host memory (the CPU
    # target) and by MindSpore ops on an accelerator: the latter route runs here on the CPU.
    monkeypatch.setattr(grad_norm_module, "device_target", lambda: target)
    rng = np.random.default_rng(7)
    cases = nonfinite = nan_norms = 0
    for _ in range(120):
        n = int(rng.integers(1, 5))
        grads = []
        for _ in range(n):
            shape = tuple(int(s) for s in rng.integers(0, 5, size=int(rng.integers(0, 3))))
            ms_dtype, np_dtype = DTYPES[int(rng.integers(len(DTYPES)))]
            x = rng.normal(size=shape) * 10 ** rng.uniform(-2, 2)
            if x.size and rng.random() < 0.1:
                x.reshape(-1)[0] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
            t = Tensor(x.astype(np.float32)).astype(ms_dtype) if np_dtype is None else Tensor(x.astype(np_dtype))
            grads.append(t)
        p = NORMS[int(rng.integers(len(NORMS)))]
        want = _numpy_norm([_values(g) for g in grads], p)
        widest = max((g.dtype for g in grads), key=lambda d: {ms.float64: 3, ms.float32: 2}.get(d, 1))
        got = get_total_norm(grads, p)
        assert got.dtype == widest and got.shape == (), (got.dtype, widest)
        want_cast = _values(Tensor(np.float64(want)).astype(widest))
        got_v = _values(got)
        if math.isnan(want):
            assert math.isnan(float(got_v)), (p, got_v)
            nonfinite += 1
            nan_norms += 1
        else:
            np.testing.assert_allclose(got_v, want_cast, rtol=1e-12 if widest == ms.float64 else 1e-6, atol=0,
                                       err_msg=f"p={p}")
            nonfinite += not math.isfinite(want)
        max_norm = float(rng.uniform(0.1, 5))
        clipped, norm = clip_grads(grads, max_norm, p)
        assert _values(norm) == got_v or (math.isnan(want) and math.isnan(float(_values(norm))))
        # torch's coefficient: a NaN norm makes every clipped gradient NaN, an inf norm zeroes
        # the finite entries
        coef = np.minimum(max_norm / (np.float64(got_v) + 1e-6), 1.0)
        for g, c in zip(grads, clipped, strict=True):
            assert c is not None and c.dtype == g.dtype and c.shape == g.shape
            with np.errstate(invalid="ignore"):
                exact = _values(g) * _values(Tensor(np.float64(coef)).astype(g.dtype))
            # the product of two values of the dtype is exact in float64: rounded once to the
            # dtype, it is the correctly rounded product an elementwise multiply gives
            want_c = _values(Tensor(exact).astype(g.dtype))
            np.testing.assert_array_equal(_values(c), want_c)
        cases += 1
    print(f"\nget_total_norm / clip_grads on MindSpore ({target} route) vs numpy float64: {cases} cases "
          f"({nonfinite} with a non-finite norm, {nan_norms} NaN), norm types {NORMS}")
    assert nan_norms > 0 and nonfinite > nan_norms  # the NaN and inf paths were taken
