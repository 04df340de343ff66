"""The work arriving, live: the gateway counts prompt tokens at arrival (refused ones too) and output
tokens as generated, per pool (`tidegate_overload_work_tokens_total{pool,kind}`), and the
autoscaler is fed the tokens arrived since its last tick (`ScaleSignals.arrived_tokens`), so that a
pool with `autoscale.replica_tokens_per_s` scales on work (docs/autoscaling.md). No network: the
overload runtime over a real ModelPool, the gateway's ScaleLoop ticked by hand."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tidegate.config import AutoscaleConfig
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.overload import OverloadRuntime, TenantRateLimitError, estimate_prompt_tokens
from tidegate.gateway.overload_metrics import OverloadMetrics
from tidegate.gateway.scaling import ScaleLoop
from tidegate.gateway.upstream import ConnectionPool, Endpoint
from tidegate.overload_config import build_policies, parse_overload_sections
from tidegate.policy.autoscale import ScaleDecision, ScaleLayer, ScaleSignals
from tidegate.policy.health import BreakerPolicy
from tidegate.policy.identity import Identity

_ENDPOINT = Endpoint("127.0.0.1", 9, False, b"/v1", b"127.0.0.1:9")
_BODY = {"model": "m", "messages": [{"role": "user", "content": "a question of some length " * 20}],
         "max_tokens": 50}


def _runtime(sections: dict | None = None) -> tuple[OverloadRuntime, ModelPool, CollectorRegistry]:
    config = parse_overload_sections(sections or {})
    pool = ModelPool("m", [Replica("r0", "m", ConnectionPool(_ENDPOINT, 1.0), 4, "m", None, None)],
                     BreakerPolicy(), 100, 30.0, 1)
    specs = {"m": [config.limits.pool_replica(r.replica_id, r.slot_limit, r.forward_priority) for r in pool.replicas]}
    registry = CollectorRegistry()
    return OverloadRuntime(build_policies(config, specs), {"m": pool}, OverloadMetrics(registry), lambda: 100.0), \
        pool, registry


def _work(registry: CollectorRegistry, kind: str) -> float | None:
    return registry.get_sample_value("tidegate_overload_work_tokens_total", {"pool": "m", "kind": kind})


async def _serve(runtime: OverloadRuntime, request_id: str, completion_tokens: int) -> None:
    ticket = runtime.admit(runtime.clock(), request_id, Identity("t", None), "m", _BODY)
    await runtime.acquire(ticket)
    runtime.ended(ticket, None)
    runtime.settle(ticket, completion_tokens)
    await asyncio.sleep(0)


async def test_prompt_tokens_count_at_arrival_and_output_tokens_as_generated() -> None:
    runtime, _, registry = _runtime()
    await _serve(runtime, "a", completion_tokens=7)
    await _serve(runtime, "b", completion_tokens=5)
    assert _work(registry, "prompt") == 2 * estimate_prompt_tokens(_BODY)
    assert _work(registry, "output") == 12


async def test_a_refused_arrival_counts_its_prompt() -> None:
    runtime, _, registry = _runtime({"tenants": {"capped": {"api_keys": ["sk-capped"], "requests_per_minute": 1}}})
    who = runtime.authenticate(b"Bearer sk-capped")
    runtime.admit(runtime.clock(), "a", who, "m", _BODY)
    with pytest.raises(TenantRateLimitError):
        runtime.admit(runtime.clock(), "b", who, "m", _BODY)
    assert _work(registry, "prompt") == 2 * estimate_prompt_tokens(_BODY)  # demand the fleet did not hold


class _Recording:
    """Stands in for the pool's autoscaler: keeps the signals it is given."""

    replica_tokens_per_s = None  # the throughput it would divide the work by: not known

    def __init__(self) -> None:
        self.signals: list[ScaleSignals] = []

    def on_tick(self, signals: ScaleSignals) -> ScaleDecision:
        self.signals.append(signals)
        return ScaleDecision(1, ScaleLayer.HOLD, "recorded")


async def test_the_autoscaler_is_fed_the_tokens_arrived_since_its_last_tick() -> None:
    runtime, pool, registry = _runtime()
    loop = ScaleLoop({"m": pool}, {"m": AutoscaleConfig(replica_tokens_per_s=500.0)}, registry, runtime,
                     clock=lambda: 0.0)
    recording = _Recording()
    loop._pools["m"].autoscaler = recording  # type: ignore[assignment]  # a spy in the policy's place
    await _serve(runtime, "before", completion_tokens=3)
    await loop.start()  # counters from now on
    await loop.stop()
    await _serve(runtime, "a", completion_tokens=7)
    loop.tick(1.0)
    loop.tick(2.0)  # nothing arrived since
    prompt = estimate_prompt_tokens(_BODY)
    assert [s.arrived_tokens for s in recording.signals] == [prompt + 7, 0]
    # and the work served, from which an unset replica_tokens_per_s is measured (`policy.throughput`)
    assert [s.served_tokens for s in recording.signals] == [prompt + 7, 0]
    assert registry.get_sample_value("tidegate_overload_served_tokens_total", {"pool": "m"}) == 2 * prompt + 10


def test_replica_tokens_per_s_puts_the_live_policy_on_work_demand() -> None:
    runtime, pool, registry = _runtime()
    on_work = ScaleLoop({"m": pool}, {"m": AutoscaleConfig(replica_tokens_per_s=500.0)}, registry, runtime)
    assert on_work._pools["m"].autoscaler.settings.replica_tokens_per_s == 500.0
    # without overload control nothing counts the work: requests held, as before
    fifo = ScaleLoop({"m": pool}, {"m": AutoscaleConfig(replica_tokens_per_s=500.0)}, CollectorRegistry(), None)
    assert fifo._pools["m"].autoscaler.settings.replica_tokens_per_s is None


def test_an_unset_throughput_is_measured_only_where_the_work_is_counted() -> None:
    runtime, pool, registry = _runtime()
    measured = ScaleLoop({"m": pool}, {"m": AutoscaleConfig()}, registry, runtime)
    assert measured._pools["m"].autoscaler.settings.measure_throughput
    # without overload control no tokens are counted: zero served would read as no throughput
    fifo = ScaleLoop({"m": pool}, {"m": AutoscaleConfig()}, CollectorRegistry(), None)
    assert not fifo._pools["m"].autoscaler.settings.measure_throughput


async def test_the_throughput_divided_by_is_exported_once_known() -> None:
    runtime, pool, registry = _runtime()
    loop = ScaleLoop({"m": pool}, {"m": AutoscaleConfig()}, registry, runtime, clock=lambda: 0.0)
    await loop.start()
    await loop.stop()
    loop.tick(1.0)
    gauge = "tidegate_autoscale_replica_tokens_per_s"
    assert registry.get_sample_value(gauge, {"pool": "m"}) is None  # not measured yet: absent, not 0
    set_runtime, set_pool, set_registry = _runtime()
    given = ScaleLoop({"m": set_pool}, {"m": AutoscaleConfig(replica_tokens_per_s=500.0)}, set_registry, set_runtime,
                      clock=lambda: 0.0)
    given.tick(1.0)
    assert set_registry.get_sample_value(gauge, {"pool": "m"}) == 500.0
