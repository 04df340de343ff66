"""Each overload-control policy module declares a small public surface, and every name in it exists."""

from __future__ import annotations

import importlib

import pytest

MODULES = ["identity", "tiers", "admission", "queueing", "pool", "ttft_model", "shares", "prediction", "degradation", "overload"]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name: str) -> None:
    module = importlib.import_module(f"tidegate.policy.{name}")
    assert module.__all__, f"{name} declares no public surface"
    for public in module.__all__:
        assert hasattr(module, public), f"{name}.__all__ names missing {public}"


@pytest.mark.parametrize("name", MODULES)
def test_module_says_which_design_it_follows(name: str) -> None:
    module = importlib.import_module(f"tidegate.policy.{name}")
    assert module.__doc__ and len(module.__doc__.split()) > 20
