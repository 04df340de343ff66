"""The pure hooks a limiter kept outside the process (the gateway's Redis store) leans on: which
limits apply, a gateway's share of them, what the buckets have drawn, and an admission decided outside."""

from __future__ import annotations

import pytest

from tidegate.policy.admission import (
    AdmissionDecision,
    AdmissionOutcome,
    RateLimit,
    RateLimiter,
    Reservation,
    ScopeDraw,
)
from tidegate.policy.overload import ArrivalOutcome, OverloadControl, PoolPolicies
from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest


def test_limits_for_lists_the_tenant_limit_then_the_model_limit() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=10)},
                          model_limits={("t", "big"): RateLimit(tokens_per_minute=500)})
    scopes = limiter.limits_for("t", "big")
    assert [(s.tenant, s.model, s.limit) for s in scopes] == [
        ("t", None, RateLimit(requests_per_minute=10)), ("t", "big", RateLimit(tokens_per_minute=500))]
    assert scopes[1].label == "tenant t, model big"
    assert [s.model for s in limiter.limits_for("t", "small")] == [None]


def test_limits_for_falls_back_to_the_default_limit_and_to_none() -> None:
    assert RateLimiter(default_limit=RateLimit(requests_per_minute=5)).limits_for("anyone", "m")[0].limit == \
        RateLimit(requests_per_minute=5)
    assert RateLimiter({"t": RateLimit(requests_per_minute=5)}).limits_for("other", "m") == ()
    assert RateLimiter().unlimited and not RateLimiter({"t": RateLimit(requests_per_minute=5)}).unlimited


def test_scaled_divides_every_limit_without_rounding() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=10, tokens_per_minute=900)},
                          model_limits={("t", "big"): RateLimit(tokens_per_minute=300)},
                          default_limit=RateLimit(requests_per_minute=3)).scaled(3)
    assert limiter.limits_for("t", "big")[0].limit == RateLimit(requests_per_minute=10 / 3, tokens_per_minute=300)
    assert limiter.limits_for("t", "big")[1].limit.tokens_per_minute == 100
    assert limiter.limits_for("x", "m")[0].limit.requests_per_minute == 1
    for _ in range(3):
        assert limiter.admit(0.0, "t", "m", 1, 1).admitted
    assert not limiter.admit(0.0, "t", "m", 1, 1).admitted  # 3.33 requests: the fourth does not fit
    with pytest.raises(ValueError):
        limiter.scaled(0)


def test_drawn_reports_what_buckets_lack_after_refill() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=60, tokens_per_minute=600)},
                          model_limits={("t", "big"): RateLimit(tokens_per_minute=100)})
    limiter.admit(0.0, "t", "big", 30, 30)
    limiter.admit(0.0, "t", "m", 10, 0)
    assert set(limiter.drawn(1.0)) == {ScopeDraw("t", None, 2 - 1, 70 - 10), ScopeDraw("t", "big", 0.0, 60 - 100 / 60)}
    assert limiter.drawn(120.0) == ()  # refilled: nothing drawn


def _control() -> OverloadControl:
    tiers = default_tiers()
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=1)})
    controller = PoolController([PoolReplica("r0", max_requests=4)], tiers)
    return OverloadControl(tiers, limiter, {"m": PoolPolicies.create("m", controller)})


def _request(request_id: str, now_s: float = 0.0) -> PoolRequest:
    return PoolRequest(request_id, now_s, "t", default_tiers().default.name, 10, 20)


def _admitted(cost: int = 30) -> AdmissionDecision:
    return AdmissionDecision(AdmissionOutcome.ADMITTED, Reservation(0, "t", "m", cost), None, None, None, "")


def test_an_admission_decided_outside_replaces_the_limiter() -> None:
    control = _control()
    assert control.arrive(0.0, "m", _request("a"), admission=_admitted()).outcome is ArrivalOutcome.ASSIGNED
    # the limiter of one request per minute was never asked: its bucket is still full
    assert control.limiter.headers(0.0, "t", "m").remaining_requests == 1
    assert control.arrive(0.0, "m", _request("b"), admission=_admitted()).outcome is not ArrivalOutcome.RATE_LIMITED


def test_a_refusal_decided_outside_is_answered_as_a_rate_limit() -> None:
    refused = AdmissionDecision(AdmissionOutcome.RATE_LIMITED, None, None, 3.0, None, "limit")
    arrival = _control().arrive(0.0, "m", _request("a"), admission=refused)
    assert arrival.outcome is ArrivalOutcome.RATE_LIMITED and arrival.admission is refused


def test_finish_of_an_outside_admission_gives_the_arithmetic_and_leaves_the_limiter_alone() -> None:
    control = _control()
    control.arrive(0.0, "m", _request("a"), admission=_admitted(30))
    settlement = control.finish(1.0, "a", used_tokens=12)
    assert (settlement.reserved_tokens, settlement.refunded_tokens, settlement.charged_tokens) == (30, 18, 12.0)
    assert control.limiter.open_reservations == 0 and control.open_requests == 0
    control.arrive(1.0, "m", _request("b", 1.0), admission=_admitted(30))
    assert control.finish(1.0, "b", used_tokens=40).charged_tokens == 40.0  # an overrun is the outside's to charge
    assert control.finish(1.0, "b", used_tokens=40) is None  # idempotent
