"""The overload glue over real ModelPools (no network): admission answers, fair queueing, deadlines, slots."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tidegate.errors import AuthenticationError
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.overload import (
    DegradedReplyError,
    OverloadRuntime,
    TenantRateLimitError,
    estimate_prompt_tokens,
    extra_headers,
)
from tidegate.gateway.overload_config import build_policies, parse_overload_sections
from tidegate.gateway.overload_metrics import OverloadMetrics
from tidegate.gateway.upstream import ConnectionPool, Endpoint
from tidegate.policy.health import BreakerPolicy
from tidegate.policy.identity import Identity

_ENDPOINT = Endpoint("127.0.0.1", 9, False, b"/v1", b"127.0.0.1:9")
_BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _runtime(sections: dict | None = None, replicas: int = 1, clock=None,
             fast_path: bool = False) -> tuple[OverloadRuntime, ModelPool]:
    sections = sections or {}
    limits = sections.setdefault("limits", {})
    limits.setdefault("slots", {"initial": 1, "minimum": 1, "maximum": 8, "target_latency_s": 0.5, "window_s": 0,
                                "priority_headroom": 0})
    if not fast_path:  # a (generous) limit makes every request take the full policy path
        limits.setdefault("default", {"requests_per_minute": 1_000_000})
    config = parse_overload_sections(sections)
    pool = ModelPool("m", [Replica(f"r{i}", "m", ConnectionPool(_ENDPOINT, 1.0), 64, "m", None, None)
                           for i in range(replicas)], BreakerPolicy(), 100, 30.0, 1)
    registry = CollectorRegistry()
    runtime = OverloadRuntime(build_policies(config, ["m"]), {"m": pool}, OverloadMetrics(registry),
                              clock or FakeClock())
    runtime.registry = registry  # type: ignore[attr-defined]  # for the metric assertions
    return runtime, pool


def _metric(runtime: OverloadRuntime, name: str, **labels: str) -> float | None:
    return runtime.registry.get_sample_value(name, labels)


_TENANTS = {"tenants": {"gold": {"api_keys": ["sk-gold"], "tier": "critical"},
                        "free": {"api_keys": ["sk-free"], "tier": "sheddable"},
                        "capped": {"api_keys": ["sk-capped"], "requests_per_minute": 1}}}


def test_bad_key_is_401() -> None:
    runtime, _ = _runtime(dict(_TENANTS))
    with pytest.raises(AuthenticationError):
        runtime.authenticate(b"Bearer sk-wrong")


def test_missing_key_is_401_when_auth_is_on() -> None:
    runtime, _ = _runtime(dict(_TENANTS))
    with pytest.raises(AuthenticationError):
        runtime.authenticate(None)


def test_key_resolves_to_tenant_and_tier() -> None:
    runtime, _ = _runtime(dict(_TENANTS))
    assert runtime.authenticate(b"Bearer sk-gold") == Identity("gold", "critical")


def test_without_tenants_everyone_is_anonymous() -> None:
    runtime, _ = _runtime()
    assert runtime.authenticate(None).tenant == "anonymous"


async def test_free_slot_dispatches_at_once_and_settle_refunds() -> None:
    runtime, pool = _runtime()
    ticket = runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    replica = await runtime.acquire(ticket)
    assert replica.outstanding == 1 and ticket.dispatched_s is not None
    pool.release(replica, runtime.clock())
    runtime.settle(ticket, None, 3)
    assert runtime.control.open_requests == 0


async def test_uncontended_request_skips_the_policy_queue() -> None:
    runtime, pool = _runtime(fast_path=True)
    ticket = runtime.admit(runtime.clock(), "a", runtime.authenticate(None), "m", _BODY)
    assert ticket.replica is pool.replicas[0] and await runtime.acquire(ticket) is ticket.replica
    assert runtime.control.open_requests == 0


async def test_fast_path_is_not_taken_past_waiting_requests() -> None:
    runtime, pool = _runtime(fast_path=True)
    who = runtime.authenticate(None)
    await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    waiting = runtime.admit(runtime.clock(), "w", who, "m", _BODY)
    assert waiting.replica is None and len(pool.queue) == 1
    assert runtime.admit(runtime.clock(), "x", who, "m", _BODY).replica is None


async def test_second_request_over_rpm_gets_429_with_headers() -> None:
    runtime, _ = _runtime(dict(_TENANTS))
    who = runtime.authenticate(b"Bearer sk-capped")
    runtime.admit(runtime.clock(), "a", who, "m", _BODY)
    with pytest.raises(TenantRateLimitError) as refused:
        runtime.admit(runtime.clock(), "b", who, "m", _BODY)
    assert refused.value.status == 429 and refused.value.retry_after_s > 0
    assert b"x-ratelimit-limit-requests: 1\r\n" in extra_headers(refused.value)
    assert b"x-ratelimit-remaining-requests: 0\r\n" in extra_headers(refused.value)


async def test_admitted_request_carries_rate_limit_headers() -> None:
    runtime, _ = _runtime(dict(_TENANTS))
    ticket = runtime.admit(runtime.clock(), "a", runtime.authenticate(b"Bearer sk-capped"), "m", _BODY)
    assert b"x-ratelimit-limit-requests: 1\r\n" in ticket.response_headers


async def test_full_tier_gets_preset_reply_naming_the_rung() -> None:
    levels = {"default": "low", "levels": {"low": {"rank": 0, "queue_bound": 0, "max_queue_wait_s": 1,
                                                   "ttft_target_s": 2}}}
    runtime, _ = _runtime({"tiers": levels, "degradation": {"preset_reply": "busy, retry"}})
    with pytest.raises(DegradedReplyError) as refused:
        runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    assert refused.value.status == 503 and refused.value.message == "busy, retry"
    assert refused.value.retry_after_s >= 1
    assert b"x-tidegate-degradation: preset_reply\r\n" in extra_headers(refused.value)
    assert _metric(runtime, "tidegate_overload_degraded_responses_total", pool="m", rung="preset_reply") == 1


async def test_critical_overtakes_earlier_sheddable_when_a_slot_frees() -> None:
    runtime, pool = _runtime(dict(_TENANTS))
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    holder = await runtime.acquire(runtime.admit(runtime.clock(), "h", gold, "m", _BODY))
    sheddable = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "s", free, "m", _BODY)))
    critical = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "c", gold, "m", _BODY)))
    await asyncio.sleep(0)
    assert len(pool.queue) == 2
    pool.release(holder, runtime.clock())
    await asyncio.sleep(0)
    assert critical.done() and not sheddable.done()
    sheddable.cancel()


async def test_only_the_best_tier_takes_the_headroom_slot() -> None:
    slots = {"initial": 1, "minimum": 1, "maximum": 1, "window_s": 0, "priority_headroom": 1}
    runtime, pool = _runtime({**_TENANTS, "limits": {"slots": slots}})
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    await runtime.acquire(runtime.admit(runtime.clock(), "h", free, "m", _BODY))
    sheddable = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "s", free, "m", _BODY)))
    critical = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "c", gold, "m", _BODY)))
    await asyncio.sleep(0)
    assert critical.done() and not sheddable.done()
    assert pool.replicas[0].outstanding == 2
    sheddable.cancel()


async def test_lower_tiers_leave_the_best_tiers_recent_concurrency_free() -> None:
    slots = {"initial": 4, "minimum": 4, "maximum": 4, "window_s": 0, "priority_headroom": 0,
             "priority_reserve_half_life_s": 1.0}
    clock = FakeClock()
    runtime, pool = _runtime({**_TENANTS, "limits": {"slots": slots}}, clock=clock)
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    held = runtime.admit(clock(), "g", gold, "m", _BODY)
    await runtime.acquire(held)
    clock.now_s += 10.0  # one critical request held for a while: Poisson(1) needs 2 slots 90 % of the time
    runtime.settle(held, None, 0)
    pool.release(pool.replicas[0], clock())
    for name in ("s1", "s2"):
        await runtime.acquire(runtime.admit(clock(), name, free, "m", _BODY))
    sheddable = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "s3", free, "m", _BODY)))
    critical = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "c", gold, "m", _BODY)))
    await asyncio.sleep(0)
    assert critical.done() and not sheddable.done()
    sheddable.cancel()


async def test_replica_limits_aim_at_the_best_tiers_target_while_it_is_present() -> None:
    slots = {"initial": 4, "minimum": 1, "maximum": 8, "window_s": 0, "priority_headroom": 0,
             "target_latency_s": 0.5, "best_tier_target_latency_s": 0.1, "priority_reserve_half_life_s": 1.0}
    clock = FakeClock()
    runtime, pool = _runtime({**_TENANTS, "limits": {"slots": slots}}, clock=clock)
    replica, replica_slots = pool.replicas[0], runtime.slots["r0"]
    runtime.first_token(replica, 0.05)
    assert replica_slots.target_latency_s == 0.5  # no critical traffic yet
    gold = runtime.authenticate(b"Bearer sk-gold")
    held = runtime.admit(clock(), "g", gold, "m", _BODY)
    await runtime.acquire(held)
    clock.now_s += 5.0  # a critical request held for a while
    runtime.first_token(replica, 0.05)
    assert replica_slots.target_latency_s == 0.1
    runtime.settle(held, None, 0)
    pool.release(replica, clock())
    clock.now_s += 30.0  # its reserve has decayed
    runtime.first_token(replica, 0.05)
    assert replica_slots.target_latency_s == 0.5


async def test_a_burst_of_the_best_tier_is_not_held_back_by_its_own_pinned_limit() -> None:
    slots = {"initial": 4, "minimum": 1, "maximum": 8, "window_s": 0, "priority_headroom": 0,
             "target_latency_s": 0.5, "best_tier_target_latency_s": 0.1, "priority_reserve_half_life_s": 1.0}
    clock = FakeClock()
    runtime, pool = _runtime({**_TENANTS, "limits": {"slots": slots}}, clock=clock)
    replica = pool.replicas[0]
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    for name in ("g1", "g2", "g3"):
        await runtime.acquire(runtime.admit(clock(), name, gold, "m", _BODY))
    clock.now_s += 10.0  # three critical requests held for a while: their mean concurrency is 3
    for _ in range(80):  # every first token misses the best tier's 0.1 s: the limit falls to the minimum
        clock.now_s += 0.05
        runtime.first_token(replica, 1.0)
    assert runtime.slots["r0"].slot_limit == 1
    # the best tier still holds its peak (Poisson(3) at 0.999: 9), bounded by the base target's limit (4)
    assert replica.slot_limit == 4
    fourth = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "g4", gold, "m", _BODY)))
    fifth = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "g5", gold, "m", _BODY)))
    sheddable = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "s1", free, "m", _BODY)))
    await asyncio.sleep(0)
    assert fourth.done() and not fifth.done() and not sheddable.done()
    fifth.cancel()
    sheddable.cancel()


def test_slot_gauges_show_the_limit_and_the_latency_it_aims_at() -> None:
    slots = {"initial": 1, "minimum": 1, "maximum": 8, "window_s": 0, "priority_headroom": 0,
             "target_latency_s": 0.5, "floor_tolerance": 1.5}
    clock = FakeClock()
    runtime, pool = _runtime({"limits": {"slots": slots}}, clock=clock)
    replica = pool.replicas[0]
    assert _metric(runtime, "tidegate_replica_slot_target_seconds", pool="m", replica="r0") == 0.5
    for _ in range(10):  # one window at the minimum limit, every answer 2 s: 0.5 s cannot be met
        clock.now_s += 0.2
        runtime.first_token(replica, 2.0)
    assert _metric(runtime, "tidegate_replica_slot_target_seconds", pool="m", replica="r0") == 3.0
    assert _metric(runtime, "tidegate_replica_slot_limit", pool="m", replica="r0") == 1


def test_best_tier_target_may_not_exceed_the_target() -> None:
    with pytest.raises(ValueError, match="best_tier_target_latency_s"):
        parse_overload_sections({"limits": {"slots": {"target_latency_s": 0.5, "best_tier_target_latency_s": 0.6}}})


async def _flooded(isolation: bool, forward_priority: bool = False):
    """One slot plus one of headroom; "noisy" holds the slot with ten more of its requests waiting."""
    slots = {"initial": 1, "minimum": 1, "maximum": 1, "window_s": 0, "priority_headroom": 1,
             "target_latency_s": 0.5, "backlog_tolerance": 1.5, "floor_tolerance": None}
    tenants = {"noisy": {"api_keys": ["sk-noisy"]}, "quiet": {"api_keys": ["sk-quiet"]}}
    clock = FakeClock()
    runtime, pool = _runtime({"tenants": tenants, "limits": {"slots": slots, "isolation": {} if isolation else None}},
                             clock=clock)
    pool.replicas[0].forward_priority = forward_priority
    noisy, quiet = runtime.authenticate(b"Bearer sk-noisy"), runtime.authenticate(b"Bearer sk-quiet")
    for i in range(10):  # "noisy" served alone for a while: the tier's service rate is known
        served = runtime.admit(clock(), f"s{i}", noisy, "m", _BODY)
        replica = await runtime.acquire(served)
        clock.now_s += 0.6
        runtime.settle(served, None, 10)
        pool.release(replica, clock())
    holder = runtime.admit(clock(), "n0", noisy, "m", _BODY)
    await runtime.acquire(holder)
    waiting = []
    for i in range(1, 11):  # the flood: ten more of the same tier wait for the one slot
        clock.now_s += 0.1
        ticket = runtime.admit(clock(), f"n{i}", noisy, "m", _BODY)
        waiting.append((ticket, asyncio.ensure_future(runtime.acquire(ticket))))
    clock.now_s += 0.1
    return runtime, pool, clock, quiet, holder, waiting


@pytest.mark.parametrize("isolation", [True, False])
async def test_a_quiet_tenant_takes_the_headroom_while_another_floods_its_tier(isolation: bool) -> None:
    runtime, pool, clock, quiet, _, waiting = await _flooded(isolation)
    first = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "q", quiet, "m", _BODY)))
    await asyncio.sleep(0)
    # within its share while "noisy" is over its own: served like the best tier, in the headroom
    assert first.done() is isolation
    assert not any(future.done() for _, future in waiting)
    assert pool.replicas[0].outstanding == (2 if isolation else 1)
    for _ in range(10):  # a window of slow answers while the flood waits for slots
        clock.now_s += 0.1
        runtime.first_token(pool.replicas[0], 0.6)
    # the flood's own backlog does not stretch the target the others' batches are held to
    aimed_s = _metric(runtime, "tidegate_replica_slot_target_seconds", pool="m", replica="r0")
    assert aimed_s == (0.5 if isolation else 0.75)
    assert _metric(runtime, "tidegate_overload_tenants_over_share", pool="m", tier="standard") == (
        1 if isolation else None)
    for future in [*(future for _, future in waiting), first]:
        future.cancel()


@pytest.mark.parametrize("forward_priority", [True, False])
async def test_a_flooding_tenants_request_goes_to_the_engine_a_priority_step_down(forward_priority: bool) -> None:
    runtime, pool, clock, quiet, holder, waiting = await _flooded(True, forward_priority)
    replica = pool.replicas[0]
    quiet_ticket = runtime.admit(clock(), "q", quiet, "m", _BODY)  # within its share: the headroom
    await asyncio.wait_for(runtime.acquire(quiet_ticket), 1.0)
    for ticket in (quiet_ticket, holder):  # both end: the flood's next request takes the slot
        runtime.settle(ticket, None, 10)
        pool.release(replica, clock())
    (flooded, taken), *rest = waiting
    await asyncio.sleep(0)
    assert taken.done() and not any(future.done() for _, future in rest)
    # standard is rank 1: 2 x rank, and one more for the flood (where the engine schedules by it)
    assert runtime.engine_priority(quiet_ticket) == 2
    assert runtime.engine_priority(flooded) == (3 if forward_priority else 2)
    # the engine serves a demoted request last: it holds no slot against the quiet tenant, who
    # has the slot and the headroom's; otherwise only the headroom's
    quiet_again = [runtime.admit(clock(), f"q{i}", quiet, "m", _BODY) for i in (2, 3)]
    acquired = [asyncio.ensure_future(runtime.acquire(ticket)) for ticket in quiet_again]
    await asyncio.sleep(0)
    assert [future.done() for future in acquired] == ([True, True] if forward_priority else [True, False])
    assert replica.slot_limit == (3 if forward_priority else 2)
    # a demoted request's time to first token is the flood's own queue in the engine: no sample
    samples = _metric(runtime, "tidegate_replica_slot_samples_total", pool="m", replica="r0", kind="ok")
    runtime.first_token(replica, 5.0, flooded)
    after = _metric(runtime, "tidegate_replica_slot_samples_total", pool="m", replica="r0", kind="ok")
    assert after == (samples if forward_priority else (samples or 0) + 1)
    runtime.settle(flooded, None, 10)
    assert replica.slot_limit == 2
    for future in acquired:
        future.cancel()
    for _, future in rest:
        future.cancel()


async def test_without_best_tier_traffic_lower_tiers_get_every_slot() -> None:
    slots = {"initial": 3, "minimum": 3, "maximum": 3, "window_s": 0, "priority_headroom": 0}
    runtime, pool = _runtime({**_TENANTS, "limits": {"slots": slots}})
    free = runtime.authenticate(b"Bearer sk-free")
    for name in ("s1", "s2", "s3"):
        await asyncio.wait_for(runtime.acquire(runtime.admit(runtime.clock(), name, free, "m", _BODY)), 1.0)
    assert pool.replicas[0].outstanding == 3


async def test_request_past_its_deadline_is_answered_by_the_timer() -> None:
    levels = {"default": "low", "levels": {"low": {"rank": 0, "max_queue_wait_s": 0.05, "ttft_target_s": 1}}}
    runtime, pool = _runtime({"tiers": levels}, clock=asyncio.get_running_loop().time)
    who = Identity("t", None)
    await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    waiting = runtime.admit(runtime.clock(), "w", who, "m", _BODY)
    with pytest.raises(DegradedReplyError):
        await asyncio.wait_for(runtime.acquire(waiting), timeout=2.0)
    assert len(pool.queue) == 0
    assert _metric(runtime, "tidegate_overload_rejections_total", pool="m", tier="low", reason="shed_deadline") == 1


async def test_client_timeout_shorter_than_the_tier_wait_sets_the_deadline() -> None:
    levels = {"default": "low", "levels": {"low": {"rank": 0, "max_queue_wait_s": 30, "ttft_target_s": 60}}}
    runtime, pool = _runtime({"tiers": levels}, clock=asyncio.get_running_loop().time)
    who = Identity("t", None)
    await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    waiting = runtime.admit(runtime.clock(), "w", who, "m", _BODY, timeout_s=0.05)
    # the tier would let it wait 30 s; the client's x-request-timeout of 50 ms answers it first
    with pytest.raises(DegradedReplyError):
        await asyncio.wait_for(runtime.acquire(waiting), timeout=2.0)
    assert len(pool.queue) == 0


async def test_client_leaving_while_queued_is_removed_and_refunded() -> None:
    runtime, pool = _runtime()
    who = Identity("t", None)
    await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    ticket = runtime.admit(runtime.clock(), "w", who, "m", _BODY)
    waiting = asyncio.ensure_future(runtime.acquire(ticket))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    runtime.settle(ticket, None, 0)
    assert len(pool.queue) == 0 and runtime.control.open_requests == 1  # only the holder


async def test_fast_samples_at_the_limit_raise_the_slot_limit() -> None:
    runtime, pool = _runtime()
    replica = await runtime.acquire(runtime.admit(runtime.clock(), "h", Identity("t", None), "m", _BODY))
    for _ in range(60):
        runtime.clock.now_s += 0.1
        runtime.first_token(replica, 0.05)
    assert replica.slot_limit > 1


async def test_raised_limit_dispatches_a_waiting_request() -> None:
    runtime, pool = _runtime()
    who = Identity("t", None)
    replica = await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    waiting = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "w", who, "m", _BODY)))
    await asyncio.sleep(0)
    for _ in range(60):
        runtime.clock.now_s += 0.1
        runtime.first_token(replica, 0.05)
    await asyncio.sleep(0)
    assert waiting.done() and replica.outstanding == 2


@pytest.mark.parametrize(("waiting", "aimed_s"), [(False, 0.5), (True, 0.75)])
async def test_requests_waiting_for_a_slot_stretch_the_replicas_target(waiting: bool, aimed_s: float) -> None:
    slots = {"initial": 1, "minimum": 1, "maximum": 8, "window_s": 0, "priority_headroom": 0,
             "target_latency_s": 0.5, "backlog_tolerance": 1.5, "floor_tolerance": None}
    runtime, pool = _runtime({"limits": {"slots": slots}})
    who = Identity("t", None)
    replica = await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    if waiting:
        queued = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "w", who, "m", _BODY)))
        await asyncio.sleep(0)
    for _ in range(10):  # one window
        runtime.clock.now_s += 0.1
        runtime.first_token(replica, 0.6)
    assert _metric(runtime, "tidegate_replica_slot_target_seconds", pool="m", replica="r0") == aimed_s
    if waiting:
        queued.cancel()


async def test_drops_back_the_slot_limit_off() -> None:
    runtime, pool = _runtime({"limits": {"slots": {"initial": 8, "maximum": 8, "window_s": 0}}})
    replica = pool.replicas[0]
    for _ in range(3):
        runtime.clock.now_s += 0.1
        runtime.ended_badly(replica, 1.0)
    assert replica.slot_limit < 8


async def test_queue_depth_gauge_reads_the_policy_queue() -> None:
    runtime, _ = _runtime()
    runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    assert _metric(runtime, "tidegate_overload_queue_depth", pool="m", tier="standard") == 1


@pytest.mark.parametrize(("body", "tokens"), [
    ({"messages": [{"role": "user", "content": "x" * 40}]}, 40 // 4 + 4 + 1),
    ({"prompt": "y" * 80}, 21),
    ({"prompt": [[1, 2, 3], "abcd"]}, 3 + 2),
    ({"input": "z" * 8}, 3),
])
def test_prompt_tokens_are_estimated_from_characters(body: dict, tokens: int) -> None:
    assert estimate_prompt_tokens(body) == tokens


async def test_full_primary_pool_degrades_to_the_fallback_pool_and_says_so() -> None:
    def pool(name: str) -> ModelPool:
        return ModelPool(name, [Replica(f"{name}0", name, ConnectionPool(_ENDPOINT, 1.0), 1, name, None, None)],
                         BreakerPolicy(), 100, 30.0, 1)

    levels = {"default": "only", "levels": {"only": {"rank": 0, "queue_bound": 1, "max_queue_wait_s": 5,
                                                     "ttft_target_s": 9}}}
    config = parse_overload_sections({"tiers": levels, "degradation": {"pools": {"big": {"fallback_pool": "small"}}},
                                      "limits": {"default": {"requests_per_minute": 1000},
                                                 "slots": {"priority_headroom": 0}}})
    pools = {"big": pool("big"), "small": pool("small")}
    runtime = OverloadRuntime(build_policies(config, pools), pools, OverloadMetrics(CollectorRegistry()), FakeClock())
    who = Identity("t", None)
    await runtime.acquire(runtime.admit(runtime.clock(), "held", who, "big", _BODY))  # big's one slot
    runtime.admit(runtime.clock(), "queued", who, "big", _BODY)  # big's tier queue is now full
    degraded = runtime.admit(runtime.clock(), "over", who, "big", _BODY)
    assert degraded.pool == "small"
    assert b"x-tidegate-degradation: fallback_pool\r\n" in degraded.response_headers
    assert (await runtime.acquire(degraded)).pool_name == "small"


async def test_request_displaced_while_waiting_follows_it_to_the_fallback_pool() -> None:
    def pool(name: str) -> ModelPool:
        return ModelPool(name, [Replica(f"{name}0", name, ConnectionPool(_ENDPOINT, 1.0), 1, name, None, None)],
                         BreakerPolicy(), 100, 30.0, 1)

    config = parse_overload_sections({**_TENANTS, "degradation": {"pools": {"big": {"fallback_pool": "small"}}},
                                      "limits": {"max_queued": 1, "slots": {"priority_headroom": 0}}})
    pools = {"big": pool("big"), "small": pool("small")}
    runtime = OverloadRuntime(build_policies(config, pools), pools, OverloadMetrics(CollectorRegistry()), FakeClock())
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    await runtime.acquire(runtime.admit(runtime.clock(), "held", gold, "big", _BODY))  # big's one slot
    sheddable = runtime.admit(runtime.clock(), "low", free, "big", _BODY)
    waiting = asyncio.ensure_future(runtime.acquire(sheddable))
    await asyncio.sleep(0)
    assert not waiting.done()
    runtime.admit(runtime.clock(), "vip", gold, "big", _BODY)  # big's queue is full: the sheddable one is displaced
    replica = await asyncio.wait_for(waiting, 1.0)
    assert replica.pool_name == "small" and sheddable.pool == "small"
    assert b"x-tidegate-degradation: fallback_pool\r\n" in sheddable.response_headers
    runtime.settle(sheddable, 10, 3)
    assert runtime.control.open_requests == 2  # "held" and "vip" remain; "low" settled once
