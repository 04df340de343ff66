"""The offline oracle: the least replica-time that meets a known need, cold starts included."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.sim.support import OUTPUT_TOKENS, PROMPT_TOKENS, capacity_rps, poisson_requests, run_fifo
from tidegate.policy.autoscale import ScaleSignals
from tidegate.sim.oracle import (ScheduledFleet, WindowSlo, meets_slo, oracle_schedule, schedule_for, simulated_need,
                                 work_per_bucket)
from tidegate.sim.seam import SimRequest

CAP = 100.0  # tokens/s a replica serves


def test_need_is_work_over_the_ceiling_of_capacity() -> None:
    # 60 s buckets: 190 tokens/s is 2 replicas at 95 %; 191 is 3
    schedule = oracle_schedule([190 * 60, 191 * 60, 10 * 60], 60.0, CAP, cold_start_s=0.0)
    assert schedule.needed == (2, 3, 1)


def test_a_replica_is_paid_from_one_cold_start_before_it_serves() -> None:
    schedule = oracle_schedule([50 * 60, 150 * 60, 150 * 60, 50 * 60], 60.0, CAP, cold_start_s=30.0)
    assert schedule.needed == (1, 2, 2, 1)
    # level 1 all along (240 s, ready at 0); level 2 serves 60-180 s, requested at 30 s
    assert schedule.replica_s == pytest.approx(240 + 150)
    assert schedule.desired_at(29.0) == 1 and schedule.desired_at(30.0) == 2 and schedule.desired_at(180.0) == 1


def test_a_gap_shorter_than_a_cold_start_is_bridged_and_a_longer_one_is_not() -> None:
    work = [150 * 60, 50 * 60, 150 * 60, 50 * 60, 50 * 60, 50 * 60, 150 * 60]
    bridged = oracle_schedule(work, 60.0, CAP, cold_start_s=60.0)  # a 60 s gap: keeping costs 60, restarting 60
    assert len([s for s in bridged.requested if s[0] < 180]) == 2  # the second level kept through the first gap
    assert bridged.replica_s == pytest.approx(7 * 60 + (180 + 60 + 60))  # level 2: 0-180 s, then 300-420 s
    apart = oracle_schedule(work, 60.0, CAP, cold_start_s=10.0)
    assert apart.replica_s == pytest.approx(7 * 60 + 60 + (60 + 10) + (60 + 10))


def test_work_per_bucket_adds_prompt_and_output_tokens() -> None:
    requests = [SimRequest(0, 1.0, "a", "standard", 10, 5), SimRequest(1, 59.0, "a", "standard", 1, 1),
                SimRequest(2, 61.0, "a", "standard", 3, 4)]
    assert work_per_bucket(requests, 60.0) == [17.0, 7.0]


def test_the_scheduled_fleet_follows_the_schedule() -> None:
    schedule = oracle_schedule([50 * 60, 150 * 60], 60.0, CAP, cold_start_s=30.0)
    fleet = ScheduledFleet(schedule)
    assert [fleet.on_tick(ScaleSignals(t, 1, 0, 0, 0, 0)).desired for t in (0.0, 31.0, 119.0)] == [1, 2, 2]


# ---- the need simulated per bucket (small seeded runs on the test replica, FIFO behind its slots)

def _run_window(requests, replicas: int):
    return run_fifo(requests, [f"r{i}" for i in range(replicas)])[0]


def _burst(seconds: float = 10.0, seed: int = 5):
    """Three replicas' worth for `seconds`, then nothing: a bucket's average is half of one replica."""
    return poisson_requests(3 * capacity_rps(), seconds, seed=seed)


def test_a_burst_within_a_bucket_needs_more_than_its_average() -> None:
    burst = _burst()
    tokens_per_s = capacity_rps() * (PROMPT_TOKENS + OUTPUT_TOKENS)
    average = oracle_schedule(work_per_bucket(burst, 60.0), 60.0, tokens_per_s, cold_start_s=0.0)
    assert average.needed == (1,)
    need = simulated_need(burst, _run_window, guess=1)
    assert need >= 3  # the ten seconds at 3x one replica must be served as they come


def test_the_simulated_need_is_the_fewest_replicas_that_meet_the_slo() -> None:
    burst, slo = _burst(), WindowSlo()
    need = simulated_need(burst, _run_window, slo, guess=6)  # searched down from above as well as up
    assert meets_slo(_run_window(burst, need), slo)
    assert not meets_slo(_run_window(burst, need - 1), slo)
    assert simulated_need(burst, _run_window, slo, guess=1) == need


def test_a_smooth_bucket_under_one_replica_needs_one() -> None:
    smooth = poisson_requests(0.5 * capacity_rps(), 60.0, seed=6)
    assert simulated_need(smooth, _run_window, guess=1) == 1


def test_meeting_the_slo_asks_for_the_share_served_and_the_p99_ttft() -> None:
    burst = _burst()
    run = _run_window(burst, 1)  # one replica: a backlog, P99 TTFT in seconds
    assert not meets_slo(run, WindowSlo())
    assert meets_slo(run, WindowSlo(p99_ttft_s=1e9))
    assert not meets_slo(run, WindowSlo(success=1.01, p99_ttft_s=1e9))


def test_schedule_for_simulates_each_bucket_and_plans_levels_from_the_needs() -> None:
    smooth = poisson_requests(0.5 * capacity_rps(), 60.0, seed=6)
    burst = tuple(replace(r, request_id=len(smooth) + i, arrival_s=r.arrival_s + 60.0) for i, r in enumerate(_burst()))
    tokens_per_s = capacity_rps() * (PROMPT_TOKENS + OUTPUT_TOKENS)
    schedule = schedule_for(smooth + burst, 60.0, 20.0, _run_window, replica_tokens_per_s=tokens_per_s)
    need = simulated_need(_burst(), _run_window)
    assert schedule.needed == (1, need)
    # level 1 all along; the burst's levels requested one cold start before the second bucket
    assert schedule.replica_s == pytest.approx(120.0 + (need - 1) * (60.0 + 20.0))
    assert schedule.desired_at(39.0) == 1 and schedule.desired_at(40.0) == need
