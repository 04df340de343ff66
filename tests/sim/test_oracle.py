"""The offline oracle: the least replica-time that meets a known need, cold starts included."""

from __future__ import annotations

import pytest

from tidegate.policy.autoscale import ScaleSignals
from tidegate.sim.oracle import ScheduledFleet, oracle_schedule, work_per_bucket
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
