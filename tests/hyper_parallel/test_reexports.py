# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The umbrella re-exports the same objects the packages define."""

import hp_dtensor
import hyper_parallel


def test_umbrella_exports_are_the_package_objects() -> None:
    for name in hyper_parallel.__all__:
        assert getattr(hyper_parallel, name) is getattr(hp_dtensor, name), name


def test_umbrella_has_no_protocol_symbols() -> None:
    assert not hasattr(hyper_parallel, "Configurable")
