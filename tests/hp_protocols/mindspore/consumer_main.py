# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,index,call-overload,union-attr"
"""The consumer check outside pytest, for a venv holding only what MindFormers would install
(MindSpore, hp-protocols, hp-dtensor): the decoder on 2 mccl ranks equals one process.  Exits
non-zero on a mismatch or when torch is importable."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
from consumer_cases import train_ms

from hp_dtensor.testing import RankPool


def main() -> int:
    import hp_dtensor
    import hp_protocols

    if importlib.util.find_spec("torch") is not None:
        print("FAIL: torch is importable; the MindSpore consumer must not need it", file=sys.stderr)
        return 1
    with RankPool(2, timeout=300, env={"HYPER_PARALLEL_PLATFORM": "mindspore"}) as pool:
        runs = pool.run(train_ms, True)
    ref_losses, ref_w, _, _ = train_ms(0, 1, False)
    for rank, (losses, final, _, _) in enumerate(runs):
        np.testing.assert_allclose(losses, ref_losses, rtol=1.5e-4, atol=1e-5, err_msg=f"rank {rank}")
        for name, value in ref_w.items():
            np.testing.assert_allclose(final[name], value, rtol=1.5e-4, atol=1e-5, err_msg=f"rank {rank} {name}")
    print(f"ok: decoder on 2 mccl ranks equals one process (losses {np.round(ref_losses, 5).tolist()}); "
          f"hp_dtensor from {hp_dtensor.__file__}, hp_protocols from {hp_protocols.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
