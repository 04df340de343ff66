"""Tier table: defaults ordered critical > standard > sheddable > batch; bad configs refused."""

from __future__ import annotations

import pytest

from tidegate.policy.tiers import TierSpec, TierTable, default_tiers


def test_default_tiers_in_priority_order() -> None:
    assert [tier.name for tier in default_tiers()] == ["critical", "standard", "sheddable", "batch"]


def test_sheddable_degrades_before_standard_and_critical() -> None:
    tiers = default_tiers()
    assert tiers["sheddable"].degrade_at_pressure < tiers["standard"].degrade_at_pressure
    assert tiers["standard"].degrade_at_pressure <= tiers["critical"].degrade_at_pressure


def test_get_without_name_is_default() -> None:
    assert default_tiers().get(None).name == "standard"


def test_duplicate_ranks_refused() -> None:
    with pytest.raises(ValueError, match="ranks"):
        TierTable([TierSpec("a", 0, 1, 1.0, 1.0), TierSpec("b", 0, 1, 1.0, 1.0)], default_tier="a")


def test_unknown_default_refused() -> None:
    with pytest.raises(ValueError, match="default"):
        TierTable([TierSpec("a", 0, 1, 1.0, 1.0)], default_tier="b")


def test_non_positive_wait_refused() -> None:
    with pytest.raises(ValueError):
        TierSpec("a", 0, 1, 0.0, 1.0)
