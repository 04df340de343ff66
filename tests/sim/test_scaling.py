"""An autoscaler driving a simulated pool: capacity arrives after its cold start, leaves by draining."""

from __future__ import annotations

import math
from dataclasses import replace

from tidegate.policy.autoscale import AutoscaleSettings, Autoscaler, FixedFleet
from tidegate.policy.tiers import default_tiers
from tidegate.sim.harness import Harness
from tidegate.sim.scaling import ScalingLoop, oscillations
from tidegate.sim.capacity import saturated_rps
from tidegate.sim.scenarios import CEILING, HEADROOM, capacity_rps, controller, mixed, replica_spec

COLD_START_S = 20.0


def _run(policy, requests, initial: int, replicas: int = 6):
    ids = [f"r{i}" for i in range(replicas)]
    harness = Harness([replace(replica_spec(i), cold_start_s=COLD_START_S) for i in ids], controller(ids, default_tiers()))
    loop = ScalingLoop(harness, policy, period_s=1.0)
    loop.install(max(r.arrival_s for r in requests), initial)
    return harness.run(requests), loop


def _step_load():
    """A minute at half of one replica, two minutes at 3 replicas' worth, a quiet ten minutes."""
    one = capacity_rps(1)
    quiet = mixed(0.5 * one, 60.0, (("a", "standard", 1.0),), seed=1)
    busy = mixed(3.0 * one, 120.0, (("a", "standard", 1.0),), seed=2)
    after = mixed(0.3 * one, 600.0, (("a", "standard", 1.0),), seed=3)
    merged = [(r.arrival_s, r) for r in quiet] + [(r.arrival_s + 60, r) for r in busy] + \
             [(r.arrival_s + 180, r) for r in after]
    return tuple(replace(r, request_id=i, arrival_s=t) for i, (t, r) in enumerate(sorted(merged, key=lambda x: x[0])))


def test_the_pool_grows_for_a_surge_and_shrinks_by_draining_after_it() -> None:
    settings = AutoscaleSettings(CEILING, min_replicas=1, max_replicas=6, cold_start_s=COLD_START_S,
                                 scale_down_window_s=120.0)
    result, loop = _run(Autoscaler(settings), _step_load(), initial=1)
    peak = max(e.ready for e in loop.events)
    assert peak >= 3  # it grew for the surge
    first_start = next(e.t_s for e in loop.events if e.starting)
    first_up = next(e.t_s for e in loop.events if e.ready > 1)
    assert first_up - first_start >= COLD_START_S - 1  # capacity only after its cold start
    assert loop.events[-1].ready < peak  # and shrank after it
    assert not any(r.failure_reason for r in result.records)  # draining aborted nothing
    assert oscillations(loop.events, 120.0) == 0
    fixed_result, fixed = _run(FixedFleet(6), _step_load(), initial=6)
    assert loop.replica_hours < 0.8 * fixed.replica_hours  # paid for less than six all along


def test_replica_hours_count_every_replica_paid_for() -> None:
    requests = mixed(1.0, 100.0, (("a", "standard", 1.0),), seed=4)
    _, loop = _run(FixedFleet(3), requests, initial=3, replicas=3)
    last_tick_s = loop.events[-1].t_s
    assert abs(loop.replica_hours - 3 * last_tick_s / 3600) < 1e-9


def test_a_warm_standby_serves_at_once_and_is_refilled() -> None:
    settings = AutoscaleSettings(CEILING, min_replicas=1, max_replicas=6, cold_start_s=COLD_START_S,
                                 scale_down_window_s=120.0)
    ids = [f"r{i}" for i in range(6)]
    harness = Harness([replace(replica_spec(i), cold_start_s=COLD_START_S) for i in ids], controller(ids, default_tiers()))
    loop = ScalingLoop(harness, Autoscaler(settings), period_s=1.0, standby=1, promote_s=2.0)
    requests = _step_load()
    loop.install(max(r.arrival_s for r in requests), 1)
    result = harness.run(requests)
    first_out = next(e.t_s for e in loop.events if e.desired > 1)
    first_more = next(e.t_s for e in loop.events if e.ready > 1)
    assert first_more - first_out <= 3.0  # the standby serves within its promotion, not a cold start
    assert loop.events[0].standby == 1
    refill = next(e for e in loop.events if e.t_s > first_out + 1)
    assert refill.standby >= 1  # a new standby is loading
    assert not any(r.failure_reason for r in result.records)
    _, plain = _run(Autoscaler(settings), _step_load(), initial=1)
    plain_first_more = next(e.t_s for e in plain.events if e.ready > 1)
    assert plain_first_more - next(e.t_s for e in plain.events if e.desired > 1) >= COLD_START_S - 1


def test_a_standby_is_paid_for_all_along() -> None:
    requests = mixed(1.0, 100.0, (("a", "standard", 1.0),), seed=4)
    ids = ["r0", "r1", "r2"]
    harness = Harness([replace(replica_spec(i), cold_start_s=COLD_START_S) for i in ids], controller(ids, default_tiers()))
    loop = ScalingLoop(harness, FixedFleet(1), period_s=1.0, standby=1)
    loop.install(max(r.arrival_s for r in requests), 1)
    harness.run(requests)
    assert abs(loop.replica_hours - 2 * loop.events[-1].t_s / 3600) < 1e-9  # one serving + one standby
    assert all(e.ready == 1 and e.standby == 1 for e in loop.events)


def test_the_simulated_pool_measures_a_replicas_throughput_while_saturated() -> None:
    # no replica_tokens_per_s: two replicas at most, the step to 3 replicas' worth saturates them for
    # two minutes, and what they serve meanwhile is what they can: between one replica's capacity
    # measured apart at the slot limit and at the engine's whole batch (the controller grants slots
    # in between: 4,292 tokens/s against 3,751 and 4,870)
    requests = _step_load()
    settings = AutoscaleSettings(CEILING, min_replicas=1, max_replicas=2, cold_start_s=COLD_START_S,
                                 scale_down_window_s=120.0)
    scaler = Autoscaler(settings)
    _run(scaler, requests, initial=1)
    prompt = round(sum(r.prompt_tokens for r in requests) / len(requests))
    output = round(sum(r.output_tokens for r in requests) / len(requests))
    at_slots, at_batch = (saturated_rps(replica_spec("r0"), prompt, output, slots) * (prompt + output)
                          for slots in (CEILING, CEILING + HEADROOM))
    assert scaler.replica_tokens_per_s is not None
    assert 0.95 * at_slots <= scaler.replica_tokens_per_s <= 1.05 * at_batch


class _Recorder:
    """A fixed fleet that keeps every tick's signals."""

    def __init__(self, replicas: int) -> None:
        self.fleet, self.signals = FixedFleet(replicas), []

    def on_tick(self, signals):
        self.signals.append(signals)
        return self.fleet.on_tick(signals)


def test_each_tick_reports_the_p99_ttft_of_its_first_tokens_against_the_target() -> None:
    # one replica under 3x its load: the queue grows, and so does each tick's P99 TTFT
    requests = mixed(3.0 * capacity_rps(1), 60.0, (("a", "standard", 1.0),), seed=5)
    harness = Harness([replica_spec("r0")], controller(["r0"], default_tiers()))
    recorder = _Recorder(1)
    ScalingLoop(harness, recorder, period_s=1.0, ttft_targets_s={"standard": 0.5}).install(60.0, 1)
    result = harness.run(requests)
    ratios = [s.ttft_ratio for s in recorder.signals]
    # the tick ending at 30 s: the first tokens of (29, 30]
    ttfts = sorted(r.ttft_s for r in result.records if r.first_token_s is not None and 29 < r.first_token_s <= 30)
    assert ttfts and ratios[30] == ttfts[math.ceil(0.99 * len(ttfts)) - 1] / 0.5
    assert ratios[55] > ratios[5]  # the queue behind one replica grows
    # without targets nothing is reported, as before
    plain, bare = _Recorder(1), Harness([replica_spec("r0")], controller(["r0"], default_tiers()))
    ScalingLoop(bare, plain, period_s=1.0).install(60.0, 1)
    bare.run(requests)
    assert len(plain.signals) == 61 and all(s.ttft_ratio is None for s in plain.signals)
