"""Goodput (DistServe's definition), percentiles and schedule lag."""

from __future__ import annotations

import pytest

from tidegate.loadgen.stats import Percentiles, Slo, lag_summary, meets_slo, summarize, timeline
from tests.loadgen.records_factory import make_record

SLO = Slo(ttft_s=0.2, tpot_s=0.1)


def test_request_meeting_both_slos_counts() -> None:
    # TPOT = (1.0 - 0.1) / (10 - 1) = 0.1 s: exactly on the SLO counts
    assert meets_slo(make_record(ttft_s=0.1, e2e_s=1.0, completion_tokens=10), SLO)


def test_slow_first_token_does_not_count() -> None:
    assert not meets_slo(make_record(ttft_s=0.3, e2e_s=1.0, completion_tokens=10), SLO)


def test_slow_decode_does_not_count() -> None:
    assert not meets_slo(make_record(ttft_s=0.1, e2e_s=2.0, completion_tokens=10), SLO)


def test_failed_request_does_not_count_however_fast() -> None:
    assert not meets_slo(make_record(status=429, reason="rate_limit_exceeded", ttft_s=0.01), SLO)


def test_one_token_answer_has_zero_tpot() -> None:
    assert make_record(ttft_s=0.1, e2e_s=5.0, completion_tokens=1).tpot_s == 0.0


def test_goodput_rate_and_attainment_count_failures_in_the_denominator() -> None:
    records = [
        make_record(0),
        make_record(1),
        make_record(2, ttft_s=0.5),
        make_record(3, status=503, reason="overloaded", ttft_s=None, e2e_s=None, completion_tokens=None),
    ]
    summary = summarize(records, target=0, tier="all", elapsed_s=4.0, slo=SLO)
    assert (summary.good, summary.goodput_rps, summary.slo_attainment_pct) == (2, 0.5, 50.0)


def test_no_slo_means_no_goodput_figures() -> None:
    summary = summarize([make_record()], target=0, tier="all", elapsed_s=1.0, slo=Slo())
    assert (summary.good, summary.goodput_rps, summary.slo_attainment_pct) == (None, None, None)


def test_percentiles_are_in_milliseconds() -> None:
    result = Percentiles.of([0.001 * i for i in range(1, 101)])
    assert (result.p50_ms, result.max_ms) == (pytest.approx(50.5), pytest.approx(100.0))


def test_lag_over_threshold_marks_the_run_behind_schedule() -> None:
    records = [make_record(i, scheduled_s=i * 0.01, sent_s=i * 0.01 + (0.05 if i % 2 else 0.0)) for i in range(100)]
    lag = lag_summary(records, threshold_ms=10.0)
    assert lag.behind_schedule and lag.late_count == 50


def test_on_time_run_is_not_behind_schedule() -> None:
    records = [make_record(i, scheduled_s=i * 0.01, sent_s=i * 0.01 + 0.0002) for i in range(100)]
    assert not lag_summary(records, threshold_ms=10.0).behind_schedule


def test_timeline_counts_rejections_by_send_second() -> None:
    records = [make_record(0, sent_s=0.5), make_record(1, sent_s=1.5, status=429, reason="rate_limit_exceeded")]
    buckets = timeline(records)
    assert [(b["sent"], b["ok"], b["rejected"]) for b in buckets[:2]] == [(1, 1, 0), (1, 0, 1)]


def test_answer_without_output_tokens_is_judged_by_ttft_alone() -> None:
    embedding = make_record(ttft_s=0.1, e2e_s=0.1, completion_tokens=None)
    assert meets_slo(embedding, SLO)
