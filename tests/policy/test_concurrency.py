"""Adaptive slot limit: grows under the target, backs off over it or on drops, converges after a 2x slowdown."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tidegate.policy.concurrency import (
    AimdSlotLimit,
    GradientSlotLimit,
    PriorityReserve,
    ReplicaSlots,
    SlotLimitBounds,
)
from tidegate.types import ReplicaLoad

BOUNDS = SlotLimitBounds(initial=10, minimum=2, maximum=100)


def _load_simulation():
    # The bench script holds the replica simulation, so the test checks what the bench prints.
    path = Path(__file__).resolve().parents[2] / "bench" / "overload_adaptive_slots_sim.py"
    spec = importlib.util.spec_from_file_location("overload_adaptive_slots_sim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _window(limit, start_s: float, latency_s: float, inflight: int, samples: int = 20) -> int:
    """Feeds one window of identical samples spread over just over a second."""
    for i in range(samples):
        limit.on_sample(start_s + 1.1 * i / (samples - 1), latency_s, inflight)
    return limit.limit


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
def test_grows_when_latency_is_under_target(make) -> None:
    assert _window(make(1.0, bounds=BOUNDS), 0.0, 0.2, inflight=10) > 10


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
def test_shrinks_when_latency_is_over_target(make) -> None:
    assert _window(make(1.0, bounds=BOUNDS), 0.0, 3.0, inflight=10) < 10


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
def test_limit_backs_off_on_drop(make) -> None:
    limit = make(1.0, bounds=BOUNDS)
    assert limit.on_sample(0.0, 0.2, 10, dropped=True) < 10  # a drop closes the window at once


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
def test_does_not_grow_when_app_limited(make) -> None:
    assert _window(make(1.0, bounds=BOUNDS), 0.0, 0.2, inflight=3) == 10


def test_does_not_grow_while_the_engine_queues() -> None:
    limit = GradientSlotLimit(1.0, bounds=BOUNDS)
    limit.on_load(0.0, ReplicaLoad(running_sequences=10, waiting_sequences=4))
    assert _window(limit, 0.0, 0.2, inflight=10) == 10


def test_stays_within_bounds() -> None:
    limit = GradientSlotLimit(1.0, bounds=BOUNDS, floor_tolerance=None)
    for k in range(40):
        _window(limit, 2.0 * k, 50.0, inflight=limit.limit)
    assert limit.limit == BOUNDS.minimum
    for k in range(40, 120):
        _window(limit, 2.0 * k, 0.01, inflight=limit.limit)
    assert limit.limit == BOUNDS.maximum


def test_no_update_before_the_window_closes() -> None:
    limit = GradientSlotLimit(1.0, bounds=BOUNDS, window_s=1.0)
    for i in range(50):
        limit.on_sample(0.01 * i, 0.1, 10)
    assert limit.limit == 10


def test_replica_slots_count_held_requests() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=SlotLimitBounds(initial=2, minimum=1, maximum=4)))
    assert slots.acquire() and slots.acquire()
    assert not slots.acquire()
    slots.release()
    assert slots.free_slots == 1


def test_release_without_acquire_is_an_error() -> None:
    with pytest.raises(ValueError):
        ReplicaSlots(AimdSlotLimit(1.0)).release()


@pytest.mark.parametrize("algorithm", [GradientSlotLimit, AimdSlotLimit])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_settles_near_the_new_best_within_30s_of_a_2x_slowdown(algorithm, seed: int) -> None:
    sim = _load_simulation()
    target_s = 0.3
    fast = sim.ReplicaModel()
    slow = replace(fast, slowdown=2.0)
    assert fast.best_limit(target_s) > 1.5 * slow.best_limit(target_s)  # the slowdown moves the best
    limit = algorithm(target_s, bounds=SlotLimitBounds(initial=4, minimum=1, maximum=512))
    trace = sim.simulate(limit, [(60.0, fast), (30.0, slow)], target_s, seed=seed)
    assert sim.settled_within(trace, 0.0, 60.0)
    assert sim.settled_within(trace, 60.0, 30.0)


def test_recovers_when_the_replica_speeds_up_again() -> None:
    sim = _load_simulation()
    fast = sim.ReplicaModel()
    limit = GradientSlotLimit(0.3, bounds=SlotLimitBounds(initial=4, minimum=1, maximum=512))
    trace = sim.simulate(limit, [(60.0, replace(fast, slowdown=2.0)), (30.0, fast)], 0.3)
    assert sim.settled_within(trace, 60.0, 30.0)


def test_priority_reserve_covers_the_best_tiers_concurrency_per_replica_most_of_the_time() -> None:
    reserve = PriorityReserve(half_life_s=1.0, coverage=0.9)
    reserve.on_change(0.0, +1)
    reserve.on_change(0.0, +1)
    reserve.on_change(0.0, +1)  # three best-tier requests held in a pool of two replicas
    # 1.5 a replica on average; Poisson(1.5): P(N <= 2) = 0.81, P(N <= 3) = 0.93
    assert reserve.reserved_per_replica(30.0, replicas=2) == 3


def test_priority_reserve_decays_to_zero_once_the_best_tier_stops() -> None:
    reserve = PriorityReserve(half_life_s=1.0)
    reserve.on_change(0.0, +1)
    reserve.on_change(30.0, -1)
    assert reserve.reserved_per_replica(30.5, replicas=1) >= 1  # still recent
    assert reserve.reserved_per_replica(60.0, replicas=1) == 0


def test_priority_reserve_ends_one_half_life_after_the_last_best_tier_request() -> None:
    reserve = PriorityReserve(half_life_s=5.0)
    reserve.on_change(0.0, +2)
    reserve.on_change(60.0, -2)  # two held for a minute: the average is 2, and decays slowly
    assert reserve.reserved_per_replica(64.0, replicas=1) >= 1
    assert reserve.average(66.0) > 0.5  # its quantile would still reserve a slot...
    assert reserve.reserved_per_replica(66.0, replicas=1) == 0  # ...but the best tier has gone
    assert reserve.peak_per_replica(66.0, replicas=1) == 0


def test_priority_reserve_without_best_tier_traffic_reserves_nothing() -> None:
    assert PriorityReserve().reserved_per_replica(100.0, replicas=4) == 0


def test_best_tier_target_applies_only_while_the_best_tier_is_present() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS), best_tier_target_s=0.5)
    slots.protect_best_tier(True)
    assert slots.target_latency_s == 0.5
    slots.inflight = 10
    # 0.8 s is under the tier-wide target but over the best tier's: the limit shrinks
    for i in range(20):
        slots.observe(1.1 * i / 19, 0.8)
    assert slots.slot_limit < 10
    slots.protect_best_tier(False)
    assert slots.target_latency_s == 1.0


def test_without_a_best_tier_target_protection_changes_nothing() -> None:
    slots = ReplicaSlots(AimdSlotLimit(1.0, bounds=BOUNDS))
    slots.protect_best_tier(True)
    assert slots.target_latency_s == 1.0


# A replica that misses a 0.3 s target even holding one request: 0.5 s + 10 ms per request held.
SLOW_HOST = dict(base_latency_s=0.5, per_request_s=0.01, knee=64)


@pytest.mark.parametrize("algorithm", [GradientSlotLimit, AimdSlotLimit])
def test_a_target_missed_at_the_minimum_aims_the_limit_at_tolerance_times_the_floor(algorithm) -> None:
    sim = _load_simulation()
    replica = sim.ReplicaModel(**SLOW_HOST)
    bounds = SlotLimitBounds(initial=4, minimum=1, maximum=512)
    pinned = algorithm(0.3, bounds=bounds, floor_tolerance=None)
    guarded = algorithm(0.3, bounds=bounds, floor_tolerance=1.5, floor_ttl_s=1000.0)
    pinned_trace = sim.simulate(pinned, [(120.0, replica)], 0.3)
    guarded_trace = sim.simulate(guarded, [(120.0, replica)], 0.3)
    assert {p.limit for p in pinned_trace if p.time_s > 60.0} == {1}  # no batch meets 0.3 s
    floor_s = replica.latency_s(1)  # the floor is a window's p90 of samples with 10 % noise: up to ~1.3x
    assert 1.5 * floor_s <= guarded.aimed_latency_s(120.0) <= 1.5 * 1.3 * floor_s
    # 1.5 x the floor is met up to 26-40 held: the limit climbs there (AIMD by +1 a window), not 1
    tail = [p.limit for p in guarded_trace if p.time_s > 60.0]
    best = replica.best_limit(guarded.aimed_latency_s(120.0))
    assert best / 2 <= sorted(tail)[len(tail) // 2] <= 1.3 * best
    served_pinned = sum(1 for p in pinned_trace if p.time_s > 60.0)
    assert sum(1 for p in guarded_trace if p.time_s > 60.0) > 10 * served_pinned


def test_the_floor_expires_and_the_target_is_tried_again() -> None:
    sim = _load_simulation()
    slow, fast = sim.ReplicaModel(**SLOW_HOST), sim.ReplicaModel()  # fast: 0.3 s met up to ~50 held
    limit = GradientSlotLimit(0.3, bounds=SlotLimitBounds(initial=4, minimum=1, maximum=512), floor_ttl_s=20.0)
    trace = sim.simulate(limit, [(60.0, slow), (60.0, fast)], 0.3)
    assert limit.aimed_latency_s(trace[-1].time_s) == 0.3
    assert sim.settled_within(trace, 60.0, 60.0)  # near the fast replica's best for 0.3 s


def test_a_target_met_at_the_minimum_sets_no_floor() -> None:
    limit = GradientSlotLimit(1.0, bounds=BOUNDS)
    k = 0
    while limit.limit > BOUNDS.minimum:  # 3 s at every limit: misses, shrinking to the minimum
        _window(limit, 2.0 * k, 3.0, inflight=limit.limit)
        k += 1
    assert limit.aimed_latency_s(2.0 * k) == 1.0
    _window(limit, 2.0 * k, 3.0, inflight=limit.limit)  # missed at the minimum: 3 s is the floor
    assert limit.aimed_latency_s(2.0 * k + 2.0) == pytest.approx(4.5)
    met = GradientSlotLimit(1.0, bounds=BOUNDS)
    for k in range(20):
        _window(met, 2.0 * k, 3.0 if met.limit > BOUNDS.minimum else 0.9, inflight=met.limit)
    assert met.aimed_latency_s(40.0) == 1.0


def test_the_floor_rule_can_be_turned_off_in_config() -> None:
    from tidegate.gateway.overload_config import SlotsConfig

    slots = SlotsConfig(target_latency_s=1.0, minimum=2, initial=10, floor_tolerance=None).new_slots()
    slots.inflight = 10
    for k in range(30):
        for i in range(20):
            slots.observe(2.0 * k + 1.1 * i / 19, 50.0)
    assert slots.slot_limit == 2 and slots.aimed_latency_s(60.0) == 1.0


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
def test_unused_slots_decay_toward_twice_the_concurrency_in_use(make) -> None:
    limit = make(1.0, bounds=BOUNDS)
    k = 0
    while limit.limit < 40:  # driven at its limit and fast: grows
        _window(limit, 2.0 * k, 0.2, inflight=limit.limit)
        k += 1
    learnt = limit.limit
    for j in range(k, k + 3):  # then only 8 held: the slots above 16 were never measured
        _window(limit, 2.0 * j, 0.2, inflight=8)
    assert 16 <= limit.limit < learnt
    for j in range(k + 3, k + 30):
        _window(limit, 2.0 * j, 0.2, inflight=8)
    assert 16 <= limit.limit <= 20  # twice what is in use (give or take one window's growth), no lower
    for j in range(k + 30, k + 60):
        _window(limit, 2.0 * j, 0.2, inflight=1)
    assert limit.limit == BOUNDS.initial  # nor below where a fresh replica starts


def test_the_floor_rule_does_not_relax_the_best_tiers_target() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=SlotLimitBounds(initial=2, minimum=2, maximum=100)),
                         best_tier_target_s=0.5)
    slots.protect_best_tier(True)
    slots.inflight = 2
    for k in range(10):  # 0.8 s at the minimum: over the best tier's 0.5 s, under the 1 s target
        for i in range(20):
            slots.observe(2.0 * k + 1.1 * i / 19, 0.8)
    assert slots.slot_limit == 2 and slots.aimed_latency_s(20.0) == 0.5
    slots.protect_best_tier(False)
    assert slots.aimed_latency_s(20.0) == 1.0


def test_each_target_resumes_from_the_limit_learnt_for_it() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS), best_tier_target_s=0.5)
    slots.inflight = 40
    for k in range(12):  # 0.5 s against the 1 s target: grows to the maximum's neighbourhood
        for i in range(20):
            slots.observe(2.0 * k + 1.1 * i / 19, 0.5)
    learnt_for_base = slots.slot_limit
    assert learnt_for_base > 40
    slots.protect_best_tier(True)  # first time: starts from the current limit and shrinks
    slots.inflight = 3
    for k in range(12, 24):  # 0.8 s against the best tier's 0.5 s
        for i in range(20):
            slots.observe(2.0 * k + 1.1 * i / 19, 0.8)
    learnt_for_best = slots.slot_limit
    assert learnt_for_best < 10
    slots.protect_best_tier(False)
    # regained by doubling each window that meets the target with the slots in use
    limits = [slots.slot_limit]
    for k in range(24, 31):
        slots.inflight = slots.slot_limit
        for i in range(10):  # exactly one window: it closes at its tenth sample, 1 s in
            slots.observe(2.0 * k + i / 9, 0.9)
        limits.append(slots.slot_limit)
    assert limits[0] == learnt_for_best, limits
    assert all(later <= 2 * earlier + 1 for earlier, later in zip(limits, limits[1:])), limits  # int() of a float
    # doubling: back within 6 windows; smoothed growth alone (at most 1.25x a window) takes 10
    assert limits[6] >= learnt_for_base, limits
    slots.protect_best_tier(True)
    assert slots.slot_limit == learnt_for_best  # tightening applies at once
    slots.protect_best_tier(True)  # no change of target: nothing moves
    assert slots.slot_limit == learnt_for_best


def test_a_limit_being_regained_stops_at_a_window_over_the_target() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS), best_tier_target_s=0.5)
    slots.protect_best_tier(True)
    slots.inflight = 10
    for k in range(3):  # 0.8 s against the best tier's 0.5 s: the limit shrinks, above the minimum
        for i in range(20):
            slots.observe(2.0 * k + 1.1 * i / 19, 0.8)
    low = slots.slot_limit
    slots.protect_best_tier(False)  # back to the 1 s target, the initial 10 to be regained
    slots.inflight = low
    for i in range(20):  # a window over the 1 s target: no doubling, and the regaining ends
        slots.observe(20.0 + 1.1 * i / 19, 1.2)
    after_miss = slots.slot_limit
    assert after_miss <= low
    for i in range(20):  # under the target again: ordinary growth only (at most 1.25x smoothed)
        slots.observe(30.0 + 1.1 * i / 19, 0.5)
    assert slots.slot_limit <= 1.25 * after_miss + 1


def test_peak_concurrency_is_a_high_poisson_quantile_of_the_best_tiers_load() -> None:
    reserve = PriorityReserve(half_life_s=1.0)
    reserve.on_change(0.0, +4)  # four best-tier requests held across two replicas: 2 each on average
    assert reserve.reserved_per_replica(100.0, replicas=2) == 4  # P(Poisson(2) <= 4) = 0.947 >= 0.9
    assert reserve.peak_per_replica(100.0, replicas=2) == 8  # P(Poisson(2) <= 8) = 0.9998, <= 7: 0.9989


def test_the_best_tier_may_hold_its_peak_past_a_pinned_limit_up_to_the_base_targets_limit() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS), best_tier_target_s=0.5)
    slots.inflight = 10
    for i in range(20):  # 0.9 s: just under the base target, the limit holds at 10
        slots.observe(1.1 * i / 19, 0.9)
    slots.protect_best_tier(True)
    for k in range(1, 10):  # 2 s: far over the best tier's target, the limit falls to the minimum
        for i in range(20):
            slots.observe(2.0 * k + 1.1 * i / 19, 2.0)
    assert slots.slot_limit == BOUNDS.minimum
    assert slots.best_tier_slots(peak_concurrency=1) == BOUNDS.minimum
    assert slots.best_tier_slots(peak_concurrency=6) == 6
    assert slots.best_tier_slots(peak_concurrency=50) == 10  # a flood of the best tier is held


@pytest.mark.parametrize(("queued", "grows"), [(False, False), (True, True)])
def test_requests_waiting_for_slots_stretch_the_target_by_the_backlog_tolerance(queued: bool, grows: bool) -> None:
    limit = GradientSlotLimit(1.0, bounds=BOUNDS, backlog_tolerance=1.5)
    for k in range(5):  # 1.2 s: over the 1 s target, under 1.5 x it
        for i in range(10):
            limit.on_sample(2.0 * k + i / 9, 1.2, inflight=limit.limit, queued=queued)
    assert (limit.limit > BOUNDS.initial) is grows
    assert limit.aimed_latency_s(10.0) == (1.5 if queued else 1.0)


def test_the_backlog_never_stretches_the_best_tiers_target() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS, backlog_tolerance=1.5), best_tier_target_s=0.5)
    slots.protect_best_tier(True)
    slots.inflight = 10
    for i in range(10):
        slots.observe(i / 9, 0.6, queued=True)
    assert slots.aimed_latency_s(1.0) == 0.5 and slots.slot_limit < 10


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
@pytest.mark.parametrize(("latency_s", "queued", "doubles"),
                         [(0.3, True, True), (0.3, False, False), (0.8, True, False)])
def test_a_limit_that_queues_requests_far_inside_the_target_doubles(make, latency_s: float, queued: bool,
                                                                     doubles: bool) -> None:
    limit = make(1.0, bounds=BOUNDS)
    for i in range(10):  # one window at the limit, answering at latency_s against a 1 s target
        limit.on_sample(i / 9, latency_s, inflight=limit.limit, queued=queued)
    assert (limit.limit == 2 * BOUNDS.initial) is doubles


@pytest.mark.parametrize("make", [GradientSlotLimit, AimdSlotLimit])
def test_doubling_stops_where_the_last_backoff_left_the_limit(make) -> None:
    # ssthresh: a limit that missed the target at 20 slots backs off, then regains by doubling only
    # up to where the backoff left it; above that it grows by the ordinary step a window
    limit = make(1.0, bounds=BOUNDS)
    for i in range(10):  # cold start: requests wait while the replica answers far inside the target
        limit.on_sample(i / 9, 0.3, inflight=limit.limit, queued=True)
    assert limit.limit == 20
    for i in range(10):  # too many slots: over the target
        limit.on_sample(2 + i / 9, 1.6, inflight=limit.limit, queued=True)
    backed_off = limit.limit
    assert backed_off < 20
    limits = []
    for window in range(3):  # far inside the target again, with a queue
        for i in range(10):
            limit.on_sample(4 + 2 * window + i / 9, 0.3, inflight=limit.limit, queued=True)
        limits.append(limit.limit)
    assert limits[0] < 2 * backed_off  # not doubled past the ceiling
    assert limits[0] >= backed_off and limits[2] > limits[0]  # still grows, a step at a time
    limit.retarget(1.0, None)  # a new target forgets the ceiling: doubling resumes
    for i in range(10):
        limit.on_sample(20 + i / 9, 0.3, inflight=limit.limit, queued=True)
    assert limit.limit >= min(BOUNDS.maximum, 2 * limits[2])  # an ordinary step grows 1.25x at most


def test_while_a_tenant_floods_the_limit_aims_at_the_latency_from_before_the_flood() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS), best_tier_target_s=0.2, isolation_tolerance=1.1)
    slots.set_protection(False, isolating=True)
    assert slots.target_latency_s == 1.0  # nothing measured before the flood yet: the target
    slots.set_protection(False, isolating=False)
    for window in range(20):  # answers at 0.4 s before the flood
        for i in range(10):
            slots.observe(window + i / 10, 0.4)
    assert slots.reference_latency_s == pytest.approx(0.4)
    slots.set_protection(False, isolating=True)
    assert slots.target_latency_s == pytest.approx(0.44)
    for window in range(20, 40):  # flood-time windows teach the reference nothing
        for i in range(10):
            slots.observe(window + i / 10, 0.9)
    assert slots.reference_latency_s == pytest.approx(0.4)
    slots.set_protection(True, isolating=True)
    assert slots.target_latency_s == 0.2  # the best tier's target comes first
    slots.set_protection(False, isolating=False)
    assert slots.target_latency_s == 1.0


def test_the_isolation_target_never_exceeds_the_base_target() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS, floor_tolerance=None), isolation_tolerance=2.0)
    for i in range(10):
        slots.observe(i / 9, 0.8)
    slots.set_protection(False, isolating=True)
    assert slots.target_latency_s == 1.0


def test_windows_with_requests_waiting_in_the_gateway_teach_the_reference_nothing() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS), isolation_tolerance=1.0)
    for i in range(10):
        slots.observe(i / 9, 0.4)
    for window in range(1, 10):  # a flood not yet detected: requests wait, answers slow down
        for i in range(10):
            slots.observe(window + i / 9, 0.9, queued=True)
    assert slots.reference_latency_s == pytest.approx(0.4)


def test_a_flood_starts_from_the_limit_in_use_not_from_the_one_the_last_flood_left() -> None:
    slots = ReplicaSlots(GradientSlotLimit(1.0, bounds=BOUNDS, floor_tolerance=None), isolation_tolerance=1.1)

    def windows(first: int, count: int, latency_s: float) -> None:
        for window in range(first, first + count):
            slots.inflight = slots.slot_limit  # driven to its limit: growth has evidence
            for i in range(10):
                slots.observe(window + i / 9, latency_s)

    windows(0, 1, 0.4)  # the latency before any flood
    slots.set_protection(False, isolating=True)  # a first, short flood: far over the target
    assert slots.target_latency_s == pytest.approx(0.44)
    windows(1, 6, 5.0)
    assert slots.slot_limit <= BOUNDS.minimum + 1
    slots.set_protection(False, isolating=False)
    windows(7, 20, 0.3)  # the limit grows back at the base target, well inside it
    grown = slots.slot_limit
    assert grown > 4 * BOUNDS.minimum
    slots.set_protection(False, isolating=True)  # the next flood
    assert slots.slot_limit == grown
