"""Degradation ladder: fallback pool -> cached answer -> preset 503; sheddable tiers degrade first."""

from __future__ import annotations

import pytest

from tidegate.policy.degradation import DEGRADATION_HEADER, DegradationLadder, LadderConfig, Rung
from tidegate.policy.tiers import default_tiers

TIERS = default_tiers()
LADDER = DegradationLadder("big", LadderConfig(fallback_pool="small", preset_reply="busy, retry later"))


@pytest.mark.parametrize(
    ("tier", "pressure", "degraded"),
    [
        ("sheddable", 0.4, False),
        ("sheddable", 0.6, True),
        ("standard", 0.6, False),
        ("critical", 0.95, False),
        ("critical", 1.0, True),
    ],
)
def test_tier_degrades_at_its_pressure(tier: str, pressure: float, degraded: bool) -> None:
    decision = LADDER.decide(TIERS[tier], pressure, fallback_has_capacity=True)
    assert decision.degraded is degraded


def test_missing_the_deadline_always_degrades() -> None:
    assert LADDER.decide(TIERS["critical"], 0.1, misses_deadline=True, fallback_has_capacity=True).degraded


@pytest.mark.parametrize(
    ("fallback_has_capacity", "cached", "rung"),
    [
        (True, True, Rung.FALLBACK_POOL),
        (False, True, Rung.CACHED_ANSWER),
        (False, False, Rung.PRESET_REPLY),
    ],
)
def test_ladder_takes_the_first_rung_that_can_serve(fallback_has_capacity: bool, cached: bool, rung: Rung) -> None:
    decision = LADDER.decide(TIERS["sheddable"], 0.9, fallback_has_capacity=fallback_has_capacity,
                             cached_answer_available=cached)
    assert decision.rung is rung


def test_preset_reply_is_503_with_retry_after_and_the_configured_text() -> None:
    decision = LADDER.decide(TIERS["sheddable"], 2.0, retry_after_s=7.5)
    assert (decision.status, decision.retry_after_s, decision.message) == (503, 7.5, "busy, retry later")


def test_preset_reply_has_a_minimum_retry_after() -> None:
    assert LADDER.decide(TIERS["sheddable"], 2.0).retry_after_s == 1.0


def test_fallback_rung_names_the_fallback_pool() -> None:
    assert LADDER.decide(TIERS["sheddable"], 0.9, fallback_has_capacity=True).pool == "small"


def test_no_fallback_configured_skips_the_rung() -> None:
    ladder = DegradationLadder("big")
    assert ladder.decide(TIERS["sheddable"], 0.9, fallback_has_capacity=True).rung is Rung.PRESET_REPLY


def test_default_preset_reply() -> None:
    assert DegradationLadder("big").decide(TIERS["sheddable"], 2.0).message == "The service is busy; please retry later."


def test_header_names_the_rung_only_when_degraded() -> None:
    assert LADDER.decide(TIERS["critical"], 0.0).headers() == {}
    assert LADDER.decide(TIERS["sheddable"], 2.0).headers() == {DEGRADATION_HEADER: "preset_reply"}


def test_next_rung_after_the_fallback_skips_it() -> None:
    decision = LADDER.next_rung(Rung.FALLBACK_POOL, fallback_has_capacity=True, cached_answer_available=True)
    assert decision.rung is Rung.CACHED_ANSWER


def test_a_pool_cannot_fall_back_to_itself() -> None:
    with pytest.raises(ValueError):
        DegradationLadder("big", LadderConfig(fallback_pool="big"))
