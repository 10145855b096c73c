"""The torch backend supplies every name of the backend contract, with the contract's signatures."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import hp_dtensor.platform.torch as torch_backend
from hp_dtensor.backend_contract import Backend, _members, contract_gaps


def test_torch_backend_conforms() -> None:
    names = _members(Backend)
    assert {"init_param_", "init_rank", "COLLECTIVES", "DTensor", "register_forward_hook", "RNG"} <= set(names)
    assert contract_gaps(torch_backend) == []
    print(f"contract members checked: {len(names)}")


def test_gaps_are_named() -> None:
    fake = types.SimpleNamespace(**{n: getattr(torch_backend, n) for n in dir(torch_backend) if not n.startswith("_")})
    del fake.init_param_
    fake.get_rank = lambda group: 0
    gaps = contract_gaps(fake)
    assert "init_param_" in gaps
    assert any(g.startswith("get_rank('group',)") for g in gaps), gaps


def test_torch_init_rank_default_backend_is_gloo(tmp_path: Path) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch_backend.init_rank(None, str(tmp_path / "store"), 0, 1, timeout_s=30)
    try:
        assert dist.get_backend() == "gloo"
    finally:
        torch_backend.destroy()


def test_torch_has_no_scheduler() -> None:
    with pytest.raises(RuntimeError, match="no scheduler"):
        torch_backend.serve_scheduler()
