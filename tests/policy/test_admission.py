"""Token-bucket RPM/TPM admission: reserve at admission, settle to usage, honest Retry-After."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.policy.admission import (
    AdmissionOutcome,
    LimitKind,
    RateLimit,
    RateLimiter,
    TokenBucket,
    format_reset,
)


def test_unlimited_tenant_is_admitted_without_headers() -> None:
    decision = RateLimiter().admit(0.0, "t", "m", 10, 10)
    assert decision.admitted and decision.headers is None


def test_request_limit_refuses_with_retry_after_from_refill() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=2)})
    assert limiter.admit(0.0, "t", "m", 1, 1).admitted
    assert limiter.admit(0.0, "t", "m", 1, 1).admitted
    refused = limiter.admit(0.0, "t", "m", 1, 1)
    assert refused.outcome is AdmissionOutcome.RATE_LIMITED
    assert refused.limit_hit is LimitKind.REQUESTS
    assert refused.retry_after_s == pytest.approx(30.0)  # one request refills in 60 s / 2
    assert "requests" in refused.message


def test_retry_after_is_enough() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=2)})
    limiter.admit(0.0, "t", "m", 1, 1)
    limiter.admit(0.0, "t", "m", 1, 1)
    retry_after_s = limiter.admit(0.0, "t", "m", 1, 1).retry_after_s
    assert limiter.admit(retry_after_s, "t", "m", 1, 1).admitted


def test_token_limit_reserves_prompt_plus_max_tokens() -> None:
    limiter = RateLimiter({"t": RateLimit(tokens_per_minute=1000)})
    assert limiter.admit(0.0, "t", "m", 100, 500).admitted
    refused = limiter.admit(0.0, "t", "m", 100, 400)  # 400 left, 500 asked
    assert refused.limit_hit is LimitKind.TOKENS
    assert refused.retry_after_s == pytest.approx(100 / (1000 / 60))


def test_settle_refunds_unused_tokens() -> None:
    limiter = RateLimiter({"t": RateLimit(tokens_per_minute=1000)})
    reservation = limiter.admit(0.0, "t", "m", 100, 500).reservation
    settlement = limiter.settle(0.0, reservation, used_tokens=150)
    assert (settlement.refunded_tokens, settlement.charged_tokens) == (450, 150)
    assert limiter.headers(0.0, "t", "m").remaining_tokens == 850


def test_settling_twice_is_an_error() -> None:
    limiter = RateLimiter({"t": RateLimit(tokens_per_minute=1000)})
    reservation = limiter.admit(0.0, "t", "m", 1, 1).reservation
    limiter.settle(0.0, reservation, 2)
    with pytest.raises(ValueError):
        limiter.settle(0.0, reservation, 2)


def test_request_larger_than_the_token_limit_is_too_large() -> None:
    decision = RateLimiter({"t": RateLimit(tokens_per_minute=100)}).admit(0.0, "t", "m", 90, 20)
    assert decision.outcome is AdmissionOutcome.TOO_LARGE and decision.retry_after_s is None


def test_model_limit_applies_on_top_of_tenant_limit() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=100)},
                          model_limits={("t", "big"): RateLimit(requests_per_minute=1)})
    assert limiter.admit(0.0, "t", "big", 1, 1).admitted
    assert not limiter.admit(0.0, "t", "big", 1, 1).admitted
    assert limiter.admit(0.0, "t", "small", 1, 1).admitted


def test_refusal_by_one_limit_charges_no_other() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=100)},
                          model_limits={("t", "big"): RateLimit(tokens_per_minute=10)})
    limiter.admit(0.0, "t", "big", 5, 5)
    before = limiter.headers(0.0, "t", "small").remaining_requests
    assert not limiter.admit(0.0, "t", "big", 1, 1).admitted
    assert limiter.headers(0.0, "t", "small").remaining_requests == before


def test_default_limit_covers_unlisted_tenants() -> None:
    limiter = RateLimiter(default_limit=RateLimit(requests_per_minute=1))
    assert limiter.admit(0.0, "new", "m", 1, 1).admitted
    assert not limiter.admit(0.0, "new", "m", 1, 1).admitted


def test_headers_use_openai_names() -> None:
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=60, tokens_per_minute=6000)})
    headers = limiter.admit(0.0, "t", "m", 50, 50).headers.as_http_headers()
    assert headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5900",
        "x-ratelimit-reset-tokens": "1s",
    }


@pytest.mark.parametrize(("seconds", "text"), [(0.02, "20ms"), (1.5, "1.5s"), (360.0, "6m0s"), (61.25, "1m1.25s")])
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_bucket_ignores_a_clock_stepping_back() -> None:
    bucket = TokenBucket(10, 1.0, now_s=100.0)
    bucket.take(100.0, 10)
    assert bucket.level(50.0) == 0.0


def test_bucket_refuses_more_than_capacity_forever() -> None:
    assert math.isinf(TokenBucket(10, 1.0, now_s=0.0).wait_s(0.0, 11))


_steps = st.lists(
    st.tuples(
        st.floats(0.0, 5.0),  # seconds since the previous step
        st.integers(0, 400),  # prompt tokens
        st.integers(0, 400),  # max_tokens
        st.integers(0, 900),  # tokens actually used
        st.booleans(),  # settle now (True) or leave it open
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_steps)
def test_bucket_conservation(steps: list[tuple[float, int, int, int, bool]]) -> None:
    """reserved - refunded = charged for every reservation; a bucket stays within [0, capacity]."""
    capacity = 2000
    limiter = RateLimiter({"t": RateLimit(requests_per_minute=50, tokens_per_minute=capacity)})
    now_s, open_reservations = 0.0, []
    for dt, prompt, max_tokens, used, settle_now in steps:
        now_s += dt
        decision = limiter.admit(now_s, "t", "m", prompt, max_tokens)
        if decision.admitted:
            open_reservations.append((decision.reservation, used))
        if settle_now and open_reservations:
            reservation, used_tokens = open_reservations.pop(0)
            settlement = limiter.settle(now_s, reservation, used_tokens)
            if used_tokens <= reservation.reserved_tokens:
                assert settlement.reserved_tokens - settlement.refunded_tokens == settlement.charged_tokens
                assert settlement.charged_tokens == used_tokens
            else:  # an overrun is charged as far as the bucket holds, never more than used
                assert reservation.reserved_tokens <= settlement.charged_tokens <= used_tokens
        headers = limiter.headers(now_s, "t", "m")
        assert 0 <= headers.remaining_tokens <= capacity
        assert 0 <= headers.remaining_requests <= 50
    assert limiter.open_reservations == len(open_reservations)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 30.0), st.booleans()), max_size=50))
def test_bucket_level_within_bounds(ops: list[tuple[float, float, bool]]) -> None:
    bucket, now_s = TokenBucket(20, 2.0, now_s=0.0), 0.0
    for dt, amount, give in ops:
        now_s += dt
        if give:
            bucket.give_back(now_s, amount)
        else:
            bucket.take(now_s, amount)
        assert 0.0 <= bucket.level(now_s) <= 20.0


def test_negative_token_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimiter({"t": RateLimit(tokens_per_minute=10)}).admit(0.0, "t", "m", -5, 1)
