"""The report's figures from a hand-made run: where requests are placed, ejection and return, survivors, recovery."""

from __future__ import annotations

import yaml

from tidegate.chaos.experiment import parse_experiment
from tidegate.chaos.process_faults import Outcome
from tidegate.chaos.report import build_report, classify
from tidegate.chaos.runner import ChaosResult, GatewaySample, TimelineEvent, label_matches
from tidegate.loadgen.records import RequestRecord

KILLED, SURVIVOR = "m#0@127.0.0.1:9001", "m#1@127.0.0.1:9002"

EXPERIMENT = parse_experiment(yaml.safe_dump({
    "duration_s": 10, "load": {"url": "http://127.0.0.1:8000", "timeout_s": 4},
    "gateway": {"metrics_url": "http://127.0.0.1:8000/metrics", "interval_s": 0.5},
    "targets": {"replicas": [{"port": 9001, "restart": "true"}]},
    "steps": [{"at_s": 2, "kill": {"target": "replicas"}}, {"at_s": 6, "restart": {"target": "replicas"}}]}))


def _record(index: int, sent_s: float, status: int = 200, reason: str | None = None,
            e2e_s: float | None = 0.5) -> RequestRecord:
    return RequestRecord(index=index, target=0, tenant="t", tier="standard", scheduled_s=sent_s, sent_s=sent_s,
                         status=status, reason=reason, ttft_s=0.1 if status == 200 else None, itl_s=(), e2e_s=e2e_s,
                         target_prompt_tokens=8, max_tokens=8, prompt_tokens=8, completion_tokens=8, headers={})


def _samples() -> list[GatewaySample]:
    samples = []
    for tick in range(20):
        t_s = tick * 0.5
        killed_healthy = 0.0 if 2.5 <= t_s < 7.0 else 1.0  # ejected 0.5 s after the kill, back 1 s after restart
        samples += [GatewaySample(t_s, "tidegate_replica_healthy", "m", KILLED, killed_healthy),
                    GatewaySample(t_s, "tidegate_replica_healthy", "m", SURVIVOR, 1.0),
                    GatewaySample(t_s, "tidegate_replica_outstanding", "m", SURVIVOR, 1.0 if t_s < 2 else 3.0)]
    return samples


def _result(records: list[RequestRecord]) -> ChaosResult:
    timeline = [TimelineEvent(2.0, 2.0, "kill", "replicas", Outcome.APPLIED, "SIGKILL 1", ("127.0.0.1:9001",)),
                TimelineEvent(6.0, 6.0, "restart", "replicas", Outcome.APPLIED, "started", ("127.0.0.1:9001",),
                              lifts=True)]
    return ChaosResult(experiment=EXPERIMENT, records=records, record_offset_s=0.0, clock_alignment_s=0.0,
                       load_elapsed_s=10.0, timeline=timeline, samples=_samples(), scrape_failures=0, proxies={},
                       notes=[], restarted=[])


def test_a_stream_broken_by_a_kill_counts_after_the_kill_not_when_it_was_sent() -> None:
    broken = _record(1, 1.8, status=200, reason="upstream_error", e2e_s=0.3)  # sent before, broke at 2.1 s
    report = build_report(_result([_record(0, 1.0), broken, _record(2, 4.0), _record(3, 8.0)]))
    assert classify(broken) == "stream_failed"
    assert report["phases"]["before"]["requests"] == 1 and report["phases"]["before"]["success_pct"] == 100
    assert report["phases"]["during"]["streams_failed"] == 1
    assert report["timeline"][0]["failed_until_next"] == 1
    assert abs(report["timeline"][0]["failing_for_s"] - 0.1) < 1e-9
    assert report["summary"]["success_pct"] == 75.0


def test_hung_requests_are_placed_when_sent_not_when_the_generator_gave_up() -> None:
    hung = _record(1, 1.0, status=0, reason="timeout", e2e_s=None)  # given up at 1 + 4 s, during the faults
    report = build_report(_result([_record(0, 0.5), hung]))
    assert report["summary"]["hung"] == 1
    assert report["phases"]["before"]["hung"] == 1


def test_ejection_and_return_are_read_from_the_first_sample_showing_them() -> None:
    reactions = build_report(_result([_record(0, 1.0)]))["gateway"]["reactions"]
    assert reactions == [
        {"t_s": 2.0, "action": "kill", "replica": KILLED, "measure": "eject", "after_s": 0.5, "note": "ejected"},
        {"t_s": 6.0, "action": "restart", "replica": KILLED, "measure": "return", "after_s": 1.0, "note": "back"},
    ]


def test_survivors_are_the_replicas_no_fault_was_aimed_at() -> None:
    (survivor,) = build_report(_result([_record(0, 1.0)]))["gateway"]["survivors"]
    assert survivor == {"replica": SURVIVOR, "outstanding_before": 1.0, "outstanding_during": 3.0, "ratio": 3.0}


def test_recovery_is_measured_from_the_event_before_the_last_failure() -> None:
    records = [_record(0, 1.0), _record(1, 3.0, status=502, reason="upstream_error", e2e_s=0.2), _record(2, 9.5)]
    recovery = build_report(_result(records))["recovery"]
    assert recovery["after_event"] == "kill replicas"
    assert abs(recovery["recovered_after_s"] - 1.2) < 1e-9
    assert not recovery["still_failing_at_end"]
    failing = build_report(_result(records + [_record(3, 9.5, status=503, reason="overloaded")]))["recovery"]
    assert failing["still_failing_at_end"] and failing["recovered_after_s"] is None


def test_without_a_gateway_nothing_about_ejection_is_claimed() -> None:
    result = _result([_record(0, 1.0)])
    result.experiment = EXPERIMENT.model_copy(update={"gateway": None})
    assert build_report(result)["gateway"] is None


def test_replica_labels_match_by_host_and_port_or_host_alone() -> None:
    assert label_matches("pool#3@10.0.0.5:8000", "10.0.0.5:8000")
    assert label_matches("pool#3@10.0.0.5:8000", "10.0.0.5")
    assert not label_matches("pool#3@10.0.0.5:8000", "10.0.0.5:80")
    assert not label_matches("pool#3@10.0.0.50:8000", "10.0.0.5")


def test_streams_failed_over_are_the_gateway_counters_growth_over_the_run() -> None:
    result = _result([_record(0, 1.0)])
    result.samples += [GatewaySample(0.0, "tidegate_stream_failovers_total", "m", "", 2.0, "resumed"),
                       GatewaySample(9.5, "tidegate_stream_failovers_total", "m", "", 5.0, "resumed"),
                       GatewaySample(9.5, "tidegate_stream_failovers_total", "m", "", 1.0, "refused")]
    assert build_report(result)["gateway"]["stream_failovers"] == {"resumed": 3, "failed": 0, "refused": 1}
