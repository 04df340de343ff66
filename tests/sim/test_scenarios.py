"""The overload scenarios of `sim.scenarios`: deterministic runs of the pool controller beside FIFO.

Each asserts what the controller holds today. Three bars of the one-brain issue are not met yet
and are asserted at what is met, so that a regression shows: the critical P99 in a 3x sheddable
burst (bar 1.2x unloaded), the others' P99 beside a noisy tenant (bar 1.1x on each of five seeds;
1.09x-1.25x, and the work served within target 0.2 % under FIFO's), and the work served
within target in a retry storm (bar >= FIFO; over three seeds 1 % under it with 64 clients and 2 %
with 512: the work budget keeps the engines' batches a little smaller than FIFO's full ones), and a
slowed replica's fitted slope (bar: 2x +-25 % within 10 s, and staying; it gets there in about 16 s
and wanders 1.9x-2.5x: a 16-sample line fitted to TTFTs that also carry decode work is noisy);
`bench/overload_scenarios.py` prints the verdicts. (The slowed replica's bar is met since each
replica's TTFT line is the pool's at its own measured speed: within 2x +-25 % from +3 s.)
"""

from __future__ import annotations

from tidegate.sim import scenarios


def test_goodput_past_capacity_holds_and_conserves_work() -> None:
    verdict = scenarios.goodput()
    assert verdict.passed, verdict.figures


def test_critical_burst_protects_critical_far_better_than_fifo_with_the_replicas_busy() -> None:
    verdict = scenarios.critical_burst()
    assert verdict.value("control_slowdown") <= 1.4, verdict.figures
    assert verdict.value("control_slowdown") < verdict.value("fifo_slowdown"), verdict.figures
    assert verdict.value("control_busy") >= 0.8, verdict.figures


def test_noisy_tenant_is_held_off_the_others_with_the_replicas_busy() -> None:
    verdict = scenarios.noisy_tenant()
    assert verdict.value("control_slowdown") <= 1.4, verdict.figures  # every seed (8x before rule 5's move)
    assert verdict.value("control_slowdown") * 5 < verdict.value("fifo_slowdown"), verdict.figures
    assert verdict.value("good") >= 0.99 * verdict.value("fifo_good"), verdict.figures
    assert verdict.value("control_busy") >= 0.8, verdict.figures


def test_scenarios_are_deterministic() -> None:
    assert scenarios.critical_burst() == scenarios.critical_burst()


def test_cold_start_at_70_percent_refuses_nothing() -> None:
    verdict = scenarios.cold_start()
    assert verdict.passed, verdict.figures


def test_long_prompt_burst_after_idle_keeps_critical_within_target_from_the_first_second() -> None:
    verdict = scenarios.burst_after_idle()
    assert verdict.passed, verdict.figures


def test_a_retry_storm_serves_fifos_good_work_with_the_replicas_busy() -> None:
    verdict = scenarios.retry_storm(scenarios.STORM_SEEDS[:3])  # the bench sums all eight
    assert verdict.passed, verdict.figures
    for count in (64, 512):  # and the noise allowed stays small: ~1 % of the work
        assert verdict.value(f"noise_{count}") <= 0.03 * verdict.value(f"fifo_good_{count}"), verdict.figures
    assert min(verdict.value("busy_64"), verdict.value("busy_512")) >= 0.8, verdict.figures


def test_a_slowed_replica_shows_twice_the_slope_within_10_s_and_stays_there_with_the_pool_busy() -> None:
    verdict = scenarios.slowed_replica()
    assert verdict.passed, verdict.figures
    assert abs(verdict.value("ratio_before") - 1.0) <= 0.1, verdict.figures


def test_a_killed_replica_costs_what_it_held_and_a_few_probes_with_the_others_busy() -> None:
    verdict = scenarios.replica_killed()
    assert verdict.passed, verdict.figures
    assert verdict.value("sent_to_dead") <= 4, verdict.figures  # one probe per cool-down, doubling from 5 s
