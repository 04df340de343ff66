"""Tenant shares: max-min fair rates, who floods a tier and who is protected from it (no event loop)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.policy.shares import DecayingRate, TenantShares, fair_rate


@pytest.mark.parametrize(
    ("demands", "weights", "capacity", "level"),
    [
        ({"a": 1.0, "b": 1.0}, {}, 3.0, math.inf),  # everyone gets what it asks: nobody is held back
        ({"a": 5.0, "b": 5.0}, {}, 4.0, 2.0),  # equal demands over capacity: an equal split
        ({"a": 1.0, "b": 1.0, "c": 1.0, "n": 20.0}, {}, 5.0, 2.0),  # the small ones fit; the flood gets the rest
        ({"a": 1.0, "n": 20.0}, {"n": 3.0}, 5.0, 4.0 / 3.0),  # n's weight 3: its level counts per unit weight
        ({"a": 3.0, "n": 20.0}, {"a": 2.0}, 4.0, 4.0 / 3.0),  # a (weight 2) is held to 2 x level too
        ({"a": 1.0}, {}, 0.0, 0.0),  # nothing served yet
    ],
)
def test_fair_rate_is_the_water_filling_level(demands: dict, weights: dict, capacity: float, level: float) -> None:
    assert fair_rate(demands, weights, capacity) == pytest.approx(level)


@given(st.dictionaries(st.sampled_from("abcdef"), st.floats(0.01, 100.0), min_size=1),
       st.floats(0.01, 500.0))
def test_fair_allocations_add_up_to_capacity_and_never_exceed_demand(demands: dict, capacity: float) -> None:
    level = fair_rate(demands, {}, capacity)
    allocated = {tenant: min(demand, level) for tenant, demand in demands.items()}
    if math.isinf(level):
        assert sum(demands.values()) <= capacity
    else:
        assert sum(allocated.values()) == pytest.approx(capacity, rel=1e-9)


def test_decaying_rate_reads_a_steady_stream_and_halves_each_half_life() -> None:
    rate = DecayingRate(half_life_s=2.0)
    for step in range(400):  # 10 units a second for 40 s
        rate.add(step * 0.1, 1.0)
    at_40 = rate.rate(40.0)
    assert at_40 == pytest.approx(10.0, rel=0.05)
    assert rate.rate(42.0) == pytest.approx(at_40 / 2, rel=1e-6)


def test_reading_a_decaying_rate_changes_nothing() -> None:
    rate, untouched = DecayingRate(half_life_s=2.0), DecayingRate(half_life_s=2.0)
    for item in (rate, untouched):
        item.add(0.0, 4.0)
    assert rate.rate(10.0) < rate.rate(1.0)  # a later read first, then an earlier one
    assert rate.amount(1.0) == untouched.amount(1.0)
    rate.add(3.0, 1.0)
    untouched.add(3.0, 1.0)
    assert rate.rate(5.0) == untouched.rate(5.0)


def _stream(shares: TenantShares, tier: str, rates: dict[str, float], served: float, seconds: float = 30.0,
            start_s: float = 0.0, dispatched: float | None = None) -> float:
    """Arrivals at `rates` (work a second, per tenant), `served` work a second finished and
    `dispatched` (default: `served`) dispatched, in 0.1 s steps."""
    now_s = start_s
    for _ in range(int(seconds * 10)):
        now_s += 0.1
        for tenant, rate in rates.items():
            shares.on_arrival(now_s, tier, tenant, rate * 0.1)
        shares.on_dispatch(now_s, tier, (served if dispatched is None else dispatched) * 0.1)
        shares.on_finish(now_s, tier, served * 0.1)
    return now_s


def _seconds_to_verdict(shares: TenantShares, now_s: float, rates: dict[str, float], served: float,
                        dispatched: float) -> float:
    start_s = now_s
    while not shares.over_share(now_s, "standard") and now_s - start_s < 10.0:
        now_s = _stream(shares, "standard", rates, served, seconds=0.1, start_s=now_s, dispatched=dispatched)
    return now_s - start_s


def test_a_flood_is_judged_within_about_a_second_though_free_slots_take_its_first_requests() -> None:
    fair, flood = {t: 1.0 for t in ("t1", "t2", "t3", "noisy")}, {"t1": 1.0, "t2": 1.0, "t3": 1.0, "noisy": 10.0}
    shares = TenantShares(half_life_s=5.0, over_share_factor=2.0)
    now_s = _stream(shares, "standard", fair, served=4.0)
    # the flood's first requests go straight into free slots (dispatched as they come) while the
    # engines still finish 4 a second; judged on dispatches, the tier looks served all it asks
    assert _seconds_to_verdict(shares, now_s, flood, served=4.0, dispatched=13.0) < 1.5
    by_dispatches = TenantShares(half_life_s=5.0, over_share_factor=2.0)
    now_s = _stream(by_dispatches, "standard", fair, served=4.0)
    assert _seconds_to_verdict(by_dispatches, now_s, flood, served=13.0, dispatched=13.0) == pytest.approx(10.0)


def test_a_tenant_at_ten_times_its_share_is_over_and_the_others_are_protected() -> None:
    shares = TenantShares(half_life_s=5.0, over_share_factor=2.0)
    now_s = _stream(shares, "standard", {"t1": 1.0, "t2": 1.0, "t3": 1.0, "noisy": 10.0}, served=4.0)
    assert shares.over_share(now_s, "standard") == {"noisy"}
    assert shares.protects(now_s, "standard", "t1") and not shares.protects(now_s, "standard", "noisy")
    # protection narrows what the tier is served; the others stay within their share all the same
    now_s = _stream(shares, "standard", {"t1": 1.0, "t2": 1.0, "t3": 1.0, "noisy": 10.0}, served=3.2,
                    start_s=now_s)
    assert shares.protects(now_s, "standard", "t2")


@pytest.mark.parametrize("load", [0.5, 1.0, 2.0, 4.0])
def test_equal_tenants_are_never_over_whatever_the_load(load: float) -> None:
    shares = TenantShares()
    now_s = _stream(shares, "standard", {t: load for t in ("t1", "t2", "t3", "t4")}, served=4.0 * min(load, 1.0))
    assert shares.over_share(now_s, "standard") == frozenset()
    assert not shares.protects(now_s, "standard", "t1")


def test_a_tenant_only_somewhat_above_the_others_is_not_flooding_when_service_falls() -> None:
    # service has fallen to 3 (as protection narrows the batches): t1's 1.6 is twice the fair level
    # of 0.77, but not twice what t2 sends; counted as a flood, it would keep the tier protected
    shares = TenantShares()
    now_s = _stream(shares, "standard", {"t1": 1.6, "t2": 1.0, "t3": 0.7, "t4": 0.8}, served=3.0)
    assert shares.over_share(now_s, "standard") == frozenset()


def test_no_verdict_in_a_tiers_first_half_life() -> None:
    shares = TenantShares(half_life_s=5.0)
    now_s = _stream(shares, "standard", {"t1": 1.0, "noisy": 20.0}, served=3.0, seconds=4.0)
    assert shares.over_share(now_s, "standard") == frozenset()
    now_s = _stream(shares, "standard", {"t1": 1.0, "noisy": 20.0}, served=3.0, seconds=2.0, start_s=now_s)
    assert shares.over_share(now_s, "standard") == {"noisy"}


def test_a_tier_that_is_served_all_it_asks_has_nobody_over() -> None:
    shares = TenantShares()
    now_s = _stream(shares, "standard", {"t1": 0.2, "big": 3.0}, served=3.2)
    assert shares.over_share(now_s, "standard") == frozenset()


def test_a_tenant_alone_in_its_tier_is_not_flooding_anyone() -> None:
    shares = TenantShares()
    now_s = _stream(shares, "sheddable", {"free": 30.0}, served=4.0)
    assert shares.over_share(now_s, "sheddable") == frozenset()
    assert not shares.protects(now_s, "sheddable", "free")


@pytest.mark.parametrize(("weight", "over"), [(1.0, {"big"}), (4.0, set())])
def test_a_tenant_with_a_bigger_weight_has_a_bigger_share(weight: float, over: set) -> None:
    shares = TenantShares(tenant_weights={"big": weight})
    # fair levels: 2.8 a unit of weight at weight 1 (big's 6 > 2 x 2.8); 0.8 at 4 (6 < 2 x 4 x 0.8)
    now_s = _stream(shares, "standard", {"t1": 1.0, "t2": 1.0, "big": 6.0}, served=4.8)
    assert shares.over_share(now_s, "standard") == over


def test_tiers_are_judged_apart() -> None:
    shares = TenantShares()
    now_s = _stream(shares, "standard", {"t1": 1.0, "noisy": 20.0}, served=3.0)
    assert shares.protects(now_s, "standard", "t1")
    assert not shares.protects(now_s, "critical", "t1")  # nobody floods the critical tier


def test_protection_ends_a_few_half_lives_after_the_flood() -> None:
    shares = TenantShares(half_life_s=2.0)
    now_s = _stream(shares, "standard", {"t1": 1.0, "noisy": 20.0}, served=3.0)
    assert shares.protects(now_s, "standard", "t1")
    now_s = _stream(shares, "standard", {"t1": 1.0}, served=2.0, seconds=20.0, start_s=now_s)
    assert shares.over_share(now_s, "standard") == frozenset()
    assert not shares.protects(now_s, "standard", "t1")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        TenantShares(half_life_s=0.0)
    with pytest.raises(ValueError):
        TenantShares(over_share_factor=0.5)


def test_a_flood_stands_out_while_the_service_rate_still_reads_low_for_everyone() -> None:
    # after idle, finishes lag arrivals by a service time: the fair level (here 0.25) is under
    # half of what every tenant sends, yet the flood still sends 10x what each of the others does
    shares = TenantShares()
    now_s = _stream(shares, "standard", {"t1": 1.0, "t2": 1.0, "t3": 1.0, "noisy": 10.0}, served=1.0,
                    dispatched=13.0)
    assert shares.over_share(now_s, "standard") == {"noisy"}
    assert shares.protects(now_s, "standard", "t1")


@pytest.mark.parametrize(("rates", "over"), [
    ({"a": 10.0, "b": 5.0, "c": 1.0, "d": 1.0}, {"a", "b"}),  # two floods, both 2x above the rest
    ({"a": 10.0, "b": 3.0, "c": 2.0, "d": 1.0}, {"a"}),  # b is no flood next to c
    ({"a": 4.0, "b": 3.0, "c": 2.5, "d": 2.0}, set()),  # no gap of 2x anywhere
])
def test_the_tenants_over_share_are_the_top_group_standing_2x_above_all_others(rates: dict, over: set) -> None:
    shares = TenantShares()
    now_s = _stream(shares, "standard", rates, served=2.0)
    assert shares.over_share(now_s, "standard") == over


def test_after_idle_a_tenants_first_few_requests_are_no_flood_but_a_real_one_is_judged_at_once() -> None:
    shares = TenantShares()
    fair = {t: 1.0 for t in ("t1", "t2", "t3", "t4")}
    now_s = _stream(shares, "standard", fair, served=4.0) + 60.0  # a minute of idle: every rate decays
    for _ in range(3):  # t1 is back first, with 3 requests; nobody else has sent yet
        now_s += 0.05
        shares.on_arrival(now_s, "standard", "t1", 0.1)
        assert shares.over_share(now_s, "standard") == frozenset()
    flood = {"t1": 1.0, "t2": 1.0, "t3": 1.0, "noisy": 10.0}
    for _ in range(10):  # a request per tenant per 0.1 s, but the flood's carry 10x the work
        now_s = _stream(shares, "standard", flood, served=1.0, seconds=0.1, start_s=now_s, dispatched=13.0)
    assert shares.over_share(now_s, "standard") == {"noisy"}
