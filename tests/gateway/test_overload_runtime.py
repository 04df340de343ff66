"""The live body of the pool controllers over real ModelPools (no network): admission answers,
assignment of waiting futures, deadlines by timer, engine levels, retries, fallback pools, metrics."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry

from tidegate.errors import AuthenticationError, OverloadedError
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.overload import (
    DegradedReplyError,
    OverloadRuntime,
    Ticket,
    TenantRateLimitError,
    estimate_prompt_tokens,
    extra_headers,
)
from tidegate.overload_config import build_policies, parse_overload_sections
from tidegate.gateway.overload_metrics import OverloadMetrics
from tidegate.gateway.upstream import ConnectionPool, Endpoint
from tidegate.policy.health import BreakerPolicy
from tidegate.policy.identity import Identity
from tidegate.types import ReplicaHealth

_ENDPOINT = Endpoint("127.0.0.1", 9, False, b"/v1", b"127.0.0.1:9")
_BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _pool(name: str, replicas: int = 1, slot_limit: int = 1, forward_priority: bool = True) -> ModelPool:
    return ModelPool(name, [Replica(f"{name}{i}" if name != "m" else f"r{i}", name, ConnectionPool(_ENDPOINT, 1.0),
                                    slot_limit, name, None, None, forward_priority=forward_priority)
                            for i in range(replicas)], BreakerPolicy(), 100, 30.0, 1)


def _runtime(sections: dict | None = None, replicas: int = 1, clock=None, slot_limit: int = 1,
             headroom_share: float = 0.0, forward_priority: bool = True,
             pool_names: tuple[str, ...] = ("m",)) -> tuple[OverloadRuntime, ModelPool]:
    sections = sections or {}
    limits = sections.setdefault("limits", {})
    limits.setdefault("headroom_share", headroom_share)
    config = parse_overload_sections(sections)
    pools = {name: _pool(name, replicas, slot_limit, forward_priority) for name in pool_names}
    specs = {name: [config.limits.pool_replica(r.replica_id, r.slot_limit, r.forward_priority) for r in pool.replicas]
             for name, pool in pools.items()}
    registry = CollectorRegistry()
    runtime = OverloadRuntime(build_policies(config, specs), pools, OverloadMetrics(registry), clock or FakeClock())
    runtime.registry = registry  # type: ignore[attr-defined]  # for the metric assertions
    return runtime, pools[pool_names[0]]


def _metric(runtime: OverloadRuntime, name: str, **labels: str) -> float | None:
    return runtime.registry.get_sample_value(name, labels)


async def _served(runtime: OverloadRuntime, ticket: Ticket, completion_tokens: int = 3) -> None:
    """The replica answered it whole; the request's handler settles it."""
    runtime.ended(ticket, None)
    runtime.settle(ticket, completion_tokens)
    await asyncio.sleep(0)


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


async def test_a_free_slot_is_assigned_at_once_and_settle_frees_it_and_refunds() -> None:
    runtime, pool = _runtime()
    ticket = runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    replica = await runtime.acquire(ticket)
    assert replica.outstanding == 1 and ticket.dispatched_s is not None
    await _served(runtime, ticket)
    assert replica.outstanding == 0 and runtime.control.open_requests == 0
    assert runtime.bodies["m"].controller.snapshot(runtime.clock()).replicas[0].requests == 0


async def test_a_waiting_request_is_assigned_when_the_slot_frees() -> None:
    runtime, pool = _runtime()
    who = Identity("t", None)
    holder = runtime.admit(runtime.clock(), "h", who, "m", _BODY)
    await runtime.acquire(holder)
    waiting = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "w", who, "m", _BODY)))
    await asyncio.sleep(0)
    assert not waiting.done() and _metric(runtime, "tidegate_overload_queue_depth", pool="m", tier="standard") == 1
    await _served(runtime, holder)
    assert (await asyncio.wait_for(waiting, 1.0)) is pool.replicas[0]


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
    # a tier that may not queue is still served when it can start at once
    holder = runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    assert holder.replica is not None
    with pytest.raises(DegradedReplyError) as refused:
        runtime.admit(runtime.clock(), "b", Identity("t", None), "m", _BODY)
    assert refused.value.status == 503 and refused.value.message == "busy, retry"
    assert refused.value.retry_after_s >= 1
    assert b"x-tidegate-degradation: preset_reply\r\n" in extra_headers(refused.value)
    assert _metric(runtime, "tidegate_overload_degraded_responses_total", pool="m", rung="preset_reply") == 1
    assert runtime.control.open_requests == 1


async def test_no_routable_replica_is_503_no_replica_at_once() -> None:
    runtime, pool = _runtime()
    pool.replicas[0].health = ReplicaHealth.UNHEALTHY
    pool.dispatch_waiting(runtime.clock())  # the health checker's wake-up
    with pytest.raises(OverloadedError) as refused:
        runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    assert refused.value.code == "no_replica" and refused.value.status == 503


async def test_critical_overtakes_earlier_sheddable_when_a_slot_frees() -> None:
    runtime, pool = _runtime(dict(_TENANTS))
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    holder = runtime.admit(runtime.clock(), "h", gold, "m", _BODY)
    await runtime.acquire(holder)
    sheddable = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "s", free, "m", _BODY)))
    critical = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "c", gold, "m", _BODY)))
    await asyncio.sleep(0)
    await _served(runtime, holder)
    assert critical.done() and not sheddable.done()
    sheddable.cancel()


async def test_only_a_better_level_takes_the_headroom() -> None:
    """Rule 5 live: a slot_limit of 2 with half as headroom: sheddable holds one, critical the other
    (the headroom is kept while a better tier has been seen lately)."""
    runtime, pool = _runtime(dict(_TENANTS), slot_limit=2, headroom_share=0.5)
    gold, free = runtime.authenticate(b"Bearer sk-gold"), runtime.authenticate(b"Bearer sk-free")
    earlier = runtime.admit(runtime.clock(), "c0", gold, "m", _BODY)
    await asyncio.wait_for(runtime.acquire(earlier), 1.0)
    await _served(runtime, earlier)
    await runtime.acquire(runtime.admit(runtime.clock(), "s1", free, "m", _BODY))
    second = asyncio.ensure_future(runtime.acquire(runtime.admit(runtime.clock(), "s2", free, "m", _BODY)))
    await asyncio.sleep(0)
    assert not second.done()
    critical = runtime.admit(runtime.clock(), "c", gold, "m", _BODY)
    assert (await asyncio.wait_for(runtime.acquire(critical), 1.0)) is pool.replicas[0]
    assert critical.priority == 0 and pool.replicas[0].outstanding == 2
    second.cancel()


async def test_with_no_better_tier_seen_a_tier_takes_the_headroom_too() -> None:
    """Rule 5 live (`small_engines`): no better tier lately, so the engine's two sequences are sheddable's."""
    runtime, pool = _runtime(dict(_TENANTS), slot_limit=2, headroom_share=0.5)
    free = runtime.authenticate(b"Bearer sk-free")
    await runtime.acquire(runtime.admit(runtime.clock(), "s1", free, "m", _BODY))
    assert (await asyncio.wait_for(runtime.acquire(runtime.admit(runtime.clock(), "s2", free, "m", _BODY)), 1.0)) \
        is pool.replicas[0]
    assert pool.replicas[0].outstanding == 2


async def test_the_engine_priority_is_the_controllers_level() -> None:
    runtime, _ = _runtime(dict(_TENANTS), slot_limit=4)
    tickets = [runtime.admit(runtime.clock(), name, runtime.authenticate(key), "m", _BODY)
               for name, key in (("c", b"Bearer sk-gold"), ("s", b"Bearer sk-free"), ("d", b"Bearer sk-capped"))]
    for ticket in tickets:
        await asyncio.wait_for(runtime.acquire(ticket), 1.0)
        runtime.first_token(ticket)  # its prefill is done: the next may go (rule 3)
    # 2 x the tier's rank: critical 0, sheddable 2, standard (the default) 1
    assert [t.priority for t in tickets] == [0, 4, 2]


async def test_a_first_token_teaches_the_budget_that_then_holds_back_a_long_prompt() -> None:
    """Rules 3 and 4 live: nothing measured, no budget (only slots); the first token teaches the
    replica's TTFT line, and then a long prompt that would start past its engine budget behind
    another's prefill waits until that prefill is done."""
    clock = FakeClock()
    runtime, pool = _runtime(slot_limit=8, clock=clock)
    who = Identity("t", None)
    first = runtime.admit(clock(), "a", who, "m", _BODY)
    await runtime.acquire(first)
    assert math.isnan(_metric(runtime, "tidegate_replica_work_budget_tokens", pool="m", replica="r0"))
    clock.now_s += 0.1
    runtime.first_token(first)  # ~6 prompt tokens in 0.1 s
    budget = _metric(runtime, "tidegate_replica_work_budget_tokens", pool="m", replica="r0")
    assert 0 < budget < 1000
    second = runtime.admit(clock(), "b", who, "m", _BODY)
    await runtime.acquire(second)  # the prefill queue was empty: it goes at once
    long_prompt = {**_BODY, "messages": [{"role": "user", "content": "x" * 4 * 1000}]}
    third = asyncio.ensure_future(runtime.acquire(runtime.admit(clock(), "c", who, "m", long_prompt)))
    await asyncio.sleep(0)
    assert not third.done()
    clock.now_s += 0.1
    runtime.first_token(second)
    assert (await asyncio.wait_for(third, 1.0)) is pool.replicas[0]


async def test_request_past_its_deadline_is_answered_by_the_timer() -> None:
    levels = {"default": "low", "levels": {"low": {"rank": 0, "max_queue_wait_s": 0.05, "ttft_target_s": 1}}}
    runtime, pool = _runtime({"tiers": levels}, clock=asyncio.get_running_loop().time)
    who = Identity("t", None)
    await runtime.acquire(runtime.admit(runtime.clock(), "h", who, "m", _BODY))
    waiting = runtime.admit(runtime.clock(), "w", who, "m", _BODY)
    with pytest.raises(DegradedReplyError):
        await asyncio.wait_for(runtime.acquire(waiting), timeout=2.0)
    assert not runtime.bodies["m"].waiting
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
    runtime.settle(ticket, 0)
    assert runtime.bodies["m"].controller.queued == 0 and runtime.control.open_requests == 1  # only the holder


async def test_a_retry_goes_to_another_replica_and_the_failed_one_is_told() -> None:
    runtime, pool = _runtime(replicas=2)
    ticket = runtime.admit(runtime.clock(), "a", Identity("t", None), "m", _BODY)
    first = await runtime.acquire(ticket)
    runtime.ended(ticket, "connect")
    second = await asyncio.wait_for(runtime.retry(ticket, "connect"), 1.0)
    assert second is not first and first.outstanding == 0 and second.outstanding == 1
    await _served(runtime, ticket)
    assert runtime.control.open_requests == 0 and second.outstanding == 0


async def test_failures_eject_a_replica_through_the_controllers_breaker() -> None:
    runtime, pool = _runtime(replicas=2, slot_limit=8)
    replica = pool.replicas[0]
    for index in range(8):
        ticket = runtime.admit(runtime.clock(), f"f{index}", Identity("t", None), "m", _BODY)
        if await runtime.acquire(ticket) is replica:
            runtime.ended(ticket, "status_5xx")
        else:
            runtime.ended(ticket, None)
        runtime.settle(ticket, 0)
    assert not replica.breaker.admits(runtime.clock())  # mirrored for readiness and metrics


@pytest.mark.parametrize(("body", "tokens"), [
    ({"messages": [{"role": "user", "content": "x" * 40}]}, 40 // 4 + 4 + 1),
    ({"prompt": "y" * 80}, 21),
    ({"prompt": [[1, 2, 3], "abcd"]}, 3 + 2),
    ({"input": "z" * 8}, 3),
])
def test_prompt_tokens_are_estimated_from_characters(body: dict, tokens: int) -> None:
    assert estimate_prompt_tokens(body) == tokens


async def test_full_primary_pool_degrades_to_the_fallback_pool_and_says_so() -> None:
    levels = {"default": "only", "levels": {"only": {"rank": 0, "queue_bound": 1, "max_queue_wait_s": 5,
                                                     "ttft_target_s": 9}}}
    runtime, _ = _runtime({"tiers": levels, "degradation": {"pools": {"big": {"fallback_pool": "small"}}}},
                          pool_names=("big", "small"))
    who = Identity("t", None)
    await runtime.acquire(runtime.admit(runtime.clock(), "held", who, "big", _BODY))  # big's one slot
    runtime.admit(runtime.clock(), "queued", who, "big", _BODY)  # big's tier queue is now full
    degraded = runtime.admit(runtime.clock(), "over", who, "big", _BODY)
    assert degraded.pool == "small"
    assert b"x-tidegate-degradation: fallback_pool\r\n" in degraded.response_headers
    assert (await runtime.acquire(degraded)).pool_name == "small"


async def test_request_displaced_while_waiting_follows_it_to_the_fallback_pool() -> None:
    runtime, _ = _runtime({**_TENANTS, "degradation": {"pools": {"big": {"fallback_pool": "small"}}},
                           "limits": {"max_queued": 1}}, pool_names=("big", "small"))
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
    await _served(runtime, sheddable)
    assert runtime.control.open_requests == 2  # "held" and "vip" remain; "low" settled once
