"""The moved-module finder: an old path whose new home is not installed says what to install."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from hp_dtensor.moved_modules import Moved, register_moved


def test_missing_distribution_names_what_to_install() -> None:
    register_moved({"hp_dtensor._gone_for_test": Moved("hp_not_installed_pkg.mod", "hp-not-installed", "0.3.0")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ModuleNotFoundError, match="pip install hp-not-installed"):
            importlib.import_module("hp_dtensor._gone_for_test")
    assert "hp_dtensor._gone_for_test" not in sys.modules


def test_unregistered_names_are_not_claimed() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hp_dtensor._never_existed_for_test")
