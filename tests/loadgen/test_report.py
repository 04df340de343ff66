"""The JSON report: versioned schema, required keys, comparison ratios, records file."""

from __future__ import annotations

import json

import orjson
import pytest

from tidegate.loadgen.driver import MetricSample, RunResult
from tidegate.loadgen.report import REQUIRED_KEYS, SCHEMA, build_report, write_report
from tidegate.loadgen.stats import Slo
from tests.loadgen.records_factory import make_record


def _result() -> RunResult:
    records = [make_record(i, target=i % 2, tier="critical" if i % 3 else "sheddable", scheduled_s=i * 0.1,
                           sent_s=i * 0.1, ttft_s=0.1 if i % 2 == 0 else 0.2) for i in range(12)]
    return RunResult(records=records, metrics=[MetricSample(0.5, 0, 'queue_depth{tier="a"}', 3.0)],
                     started_at_unix=1.0, elapsed_s=2.0, connections_opened=2, peak_in_flight=3)


def _report(targets: int = 2) -> dict:
    return build_report(_result(), config={"url": "http://127.0.0.1:1"}, slo=Slo(ttft_s=0.15), targets=targets,
                        lag_threshold_ms=10.0, credits=["credit"])


def test_report_declares_its_schema_version() -> None:
    assert _report()["schema"] == SCHEMA == "tidegate.bench.report/1"


def test_report_has_every_documented_key() -> None:
    assert set(REQUIRED_KEYS) <= set(_report())


def test_report_has_a_summary_per_target_and_tier() -> None:
    groups = {(s["target"], s["tier"]) for s in _report()["summaries"]}
    assert groups == {(t, tier) for t in (0, 1) for tier in ("all", "critical", "sheddable")}


def test_summary_fields_are_stable() -> None:
    summary = _report()["summaries"][0]
    assert {"requests", "succeeded", "statuses", "reasons", "ttft", "itl", "tpot", "e2e", "goodput_rps",
            "slo_attainment_pct", "degraded", "dropped"} <= set(summary)
    assert set(summary["ttft"]) == {"count", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"}


def test_compare_reports_ratio_of_second_target_to_first() -> None:
    ratios = _report()["comparison"]["ratios"]
    assert ratios["ttft_p50"] == pytest.approx(2.0)
    assert ratios["goodput_rps"] == 0.0  # target 1 misses the 150 ms TTFT SLO on every request


def test_single_target_has_no_comparison() -> None:
    assert _report(targets=1)["comparison"] is None


def test_report_and_records_are_written_as_json(tmp_path) -> None:
    report = _report()
    path = write_report(report, _result(), tmp_path)
    assert json.loads(path.read_text())["schema"] == SCHEMA
    lines = (tmp_path / "records.jsonl").read_bytes().splitlines()
    assert len(lines) == 12 and orjson.loads(lines[0])["index"] == 0


def test_late_sends_raise_a_warning_and_set_the_field() -> None:
    late = [make_record(i, scheduled_s=i * 0.01, sent_s=i * 0.01 + 0.05) for i in range(10)]
    result = RunResult(records=late, metrics=[], started_at_unix=1.0, elapsed_s=1.0, connections_opened=1,
                       peak_in_flight=1)
    report = build_report(result, config={}, slo=Slo(), targets=1, lag_threshold_ms=10.0)
    assert report["schedule_lag"]["behind_schedule"] is True
    assert any("behind its schedule" in w for w in report["warnings"])


def test_closed_loop_lag_is_not_a_warning() -> None:
    late = [make_record(i, scheduled_s=0.0, sent_s=1.0) for i in range(10)]
    result = RunResult(records=late, metrics=[], started_at_unix=1.0, elapsed_s=1.0, connections_opened=1,
                       peak_in_flight=1)
    assert build_report(result, config={}, slo=Slo(), targets=1, lag_threshold_ms=10.0, open_loop=False)["warnings"] == []


def test_phases_summarise_requests_by_send_time() -> None:
    report = build_report(_result(), config={}, slo=Slo(), targets=2, lag_threshold_ms=10.0,
                          phases=[("before", 0.0, 0.55), ("after", 0.55, 1.2)])
    counts = [sum(s["requests"] for s in p["summaries"] if s["tier"] == "all") for p in report["phases"]]
    assert counts == [6, 6]
