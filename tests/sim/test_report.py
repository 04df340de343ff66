"""The run summary: counts that add up, and text that is the same for the same run."""

from __future__ import annotations

from dataclasses import replace

from tests.sim.support import poisson_requests, run_fifo
from tidegate.policy.tiers import TierSpec, TierTable
from tidegate.sim.harness import RunResult
from tidegate.sim.report import format_summary, summarize

TIERS = TierTable((TierSpec("critical", 0, queue_bound=100, max_queue_wait_s=0.5, ttft_target_s=0.3),
                   TierSpec("standard", 1, queue_bound=100, max_queue_wait_s=2.0, ttft_target_s=1.0)),
                  default_tier="standard")


def _overloaded_mixed_run() -> RunResult:
    requests = [*poisson_requests(6.0, 10.0, seed=1, tier="critical"),
                *poisson_requests(6.0, 10.0, seed=2, tier="standard")]
    # two seeded streams merged: renumbered in arrival order, as one scenario's ids would be
    requests = [replace(r, request_id=i) for i, r in enumerate(sorted(requests, key=lambda r: (r.arrival_s, r.tier)))]
    return run_fifo(requests, tiers=TIERS)[0]


def test_every_request_is_counted_once_per_tier() -> None:
    summary = summarize(_overloaded_mixed_run(), TIERS)
    assert [t.tier for t in summary.tiers] == ["critical", "standard"]
    for tier in summary.tiers:
        assert tier.served + tier.refused + tier.failed + tier.unsettled == tier.arrived
        assert tier.good <= tier.served and tier.refused > 0  # 12 rps against about 5 of capacity
        assert tier.ttft_p50_s <= tier.ttft_p99_s


def test_goodput_counts_only_requests_within_their_tier_target() -> None:
    result = _overloaded_mixed_run()
    summary = summarize(result, TIERS)
    for tier in summary.tiers:
        target_s = TIERS[tier.tier].ttft_target_s
        good = [r for r in result.records if r.tier == tier.tier and r.served and r.ttft_s <= target_s]
        assert tier.good == len(good) and tier.goodput_rps == len(good) / result.end_s


def test_the_same_run_prints_the_same_text() -> None:
    text = format_summary(summarize(_overloaded_mixed_run(), TIERS))
    assert text == format_summary(summarize(_overloaded_mixed_run(), TIERS))
    assert "critical" in text and "queue_wait" in text and "r0" in text
