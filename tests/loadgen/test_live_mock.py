"""Short real runs against a real `tidegate mock-upstream` subprocess (loopback, bounded)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import uvloop

from tests.support import free_port, start_process, tidegate_argv
from tidegate.cli import main
from tidegate.loadgen.arrivals import Constant
from tidegate.loadgen.driver import Driver, RunConfig
from tidegate.loadgen.http_client import parse_url
from tidegate.loadgen.mix import DEFAULT_TENANT, parse_length
from tidegate.loadgen.plan import TrafficStream, build_plan
from tidegate.loadgen.records import ApiKind
from tidegate.loadgen.stats import Slo, summarize

pytestmark = pytest.mark.slow

TTFT_MS, ITL_MS, TOKENS = 40.0, 10.0, 8


def _mock(*extra: str):
    port = free_port()
    process = start_process(
        tidegate_argv("mock-upstream", "--port", str(port), "--tokens", str(TOKENS), "--ttft-ms", str(TTFT_MS),
                      "--itl-ms", str(ITL_MS), "--seed", "1", *extra),
        ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30,
    )
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def clean_mock():
    process, url = _mock()
    yield url
    process.stop()


@pytest.fixture(scope="module")
def faulty_mock():
    process, url = _mock("--error-rate", "0.3")
    yield url
    process.stop()


def _run(url: str, *, rate: float = 100.0, count: int = 60, stream: bool = True, **config):
    stream_spec = TrafficStream(Constant(rate), (DEFAULT_TENANT,), parse_length("const:32"), parse_length("const:64"))
    plan = build_plan([stream_spec], np.random.default_rng(0), max_requests=count)
    run_config = RunConfig(targets=(parse_url(url),), kind=ApiKind.CHAT, stream=stream, timeout_s=10.0, **config)
    return uvloop.run(Driver(run_config, plan).run())


def test_streaming_latencies_match_the_mock_configuration(clean_mock) -> None:
    result = _run(clean_mock)
    summary = summarize(result.records, target=0, tier="all", elapsed_s=result.elapsed_s, slo=Slo())
    assert summary.succeeded == 60
    # sane, not the accuracy bar (that is bench/loadgen_accuracy.py): timers tick in milliseconds
    assert TTFT_MS <= summary.ttft.p50_ms < TTFT_MS + 5
    assert ITL_MS - 2 < summary.itl.p50_ms < ITL_MS + 2
    assert summary.itl.count == 60 * (TOKENS - 1)


def test_usage_tokens_are_recorded(clean_mock) -> None:
    result = _run(clean_mock, count=5)
    assert {r.completion_tokens for r in result.records} == {TOKENS}


def test_open_loop_does_not_wait_for_responses(clean_mock) -> None:
    # each request takes ~110 ms; 30 sends at 300/s must all leave within ~0.1 s of starting
    result = _run(clean_mock, rate=300.0, count=30)
    assert result.peak_in_flight > 10
    assert max(r.sent_s - r.scheduled_s for r in result.records) < 0.05


def test_inflight_cap_drops_and_counts_instead_of_queueing(clean_mock) -> None:
    result = _run(clean_mock, rate=300.0, count=30, max_inflight=3)
    dropped = [r for r in result.records if r.reason == "dropped_inflight_cap"]
    assert len(result.records) == 30 and len(dropped) > 0 and result.peak_in_flight <= 3


def test_closed_loop_keeps_exactly_the_concurrency(clean_mock) -> None:
    result = _run(clean_mock, count=12, concurrency=3)
    assert len(result.records) == 12 and result.peak_in_flight == 3


def test_connections_are_kept_alive_and_reused(clean_mock) -> None:
    result = _run(clean_mock, count=12, concurrency=3, stream=False)
    assert result.connections_opened == 3


def test_cli_replays_the_trace_compressed(clean_mock, tmp_path) -> None:
    code = main(["bench", "--url", clean_mock, "--arrival", "trace", "--speedup", "600", "--requests", "40",
                 "--no-stream", "--no-progress", "--quiet", "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0 and report["summaries"][0]["succeeded"] == 40
    assert "Splitwise" in report["credits"][0]


def test_injected_errors_are_counted_with_their_reason(faulty_mock) -> None:
    result = _run(faulty_mock, rate=200.0, count=100, stream=False)
    failed = [r for r in result.records if not r.ok]
    assert 15 <= len(failed) <= 45  # 30 % of 100; binomial 3 sigma is about +-14
    assert all(r.status == 500 for r in failed) and all(r.reason for r in failed)


def test_cli_writes_a_report_with_plots(clean_mock, tmp_path) -> None:
    code = main(["bench", "--url", clean_mock, "--arrival", "poisson", "--rate", "50", "--requests", "20",
                 "--tenant", "a:ka:critical:1", "--tenant", "b:kb:sheddable:1", "--slo-ttft-ms", "500",
                 "--scrape-metrics", "--metric", "inflight", "--no-progress", "--quiet", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0 and report["summaries"][0]["requests"] == 20
    assert {s["tier"] for s in report["summaries"]} == {"all", "critical", "sheddable"}
    assert (tmp_path / "latency.png").stat().st_size > 0


def test_cli_judges_each_tier_by_its_target_in_a_serve_config(clean_mock, tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    # critical's target is far under any answer's time, sheddable's far over: goodput splits by tier
    config.write_text("pools: [{name: p, backends: [{type: upstream, url: 'http://127.0.0.1:1/v1'}]}]\n"
                      "tiers:\n  levels:\n"
                      "    critical: {rank: 0, queue_bound: 10, max_queue_wait_s: 0.0001, ttft_target_s: 0.0001}\n"
                      "    sheddable: {rank: 1, queue_bound: 10, max_queue_wait_s: 60, ttft_target_s: 60}\n"
                      "  default: sheddable\n")
    code = main(["bench", "--url", clean_mock, "--requests", "20", "--rate", "50", "--tenant", "a:ka:critical:1",
                 "--tenant", "b:kb:sheddable:1", "--config", str(config), "--no-progress", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    good = {s["tier"]: (s["good"], s["succeeded"]) for s in report["summaries"]}
    assert code == 0 and good["critical"][0] == 0 and good["sheddable"][0] == good["sheddable"][1] > 0
    assert {t["name"] for t in report["tiers"]} == {"critical", "sheddable"}


def test_report_never_contains_api_keys(clean_mock, tmp_path) -> None:
    main(["bench", "--url", clean_mock, "--requests", "2", "--tenant", "a:sk-secret-123:critical:1",
          "--no-progress", "--quiet", "--no-plots", "--out", str(tmp_path)])
    assert "sk-secret-123" not in (tmp_path / "report.json").read_text()
    assert "sk-secret-123" not in (tmp_path / "records.jsonl").read_text()


def test_cli_compare_alternates_targets(clean_mock, tmp_path) -> None:
    main(["bench", "--url", clean_mock, "--compare", clean_mock, "--rate", "100", "--requests", "20", "--no-stream",
          "--no-progress", "--quiet", "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    per_target = [s["requests"] for s in report["summaries"] if s["tier"] == "all"]
    assert per_target == [10, 10] and report["comparison"]["ratios"]["ttft_p50"] is not None


def test_surge_scenario_reports_each_phase_per_tier(clean_mock, tmp_path) -> None:
    code = main(["bench", "--scenario", "surge", "--url", clean_mock, "--duration", "3", "--no-stream",
                 "--no-progress", "--quiet", "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0 and [p["name"] for p in report["phases"]] == ["before", "surge", "after"]
    assert {s["tier"] for s in report["phases"][1]["summaries"]} == {"all", "critical", "sheddable"}


def test_model_defaults_to_the_first_the_target_lists(clean_mock) -> None:
    from tidegate.loadgen.cli import first_listed_model
    from tidegate.loadgen.http_client import parse_url

    assert first_listed_model(parse_url(clean_mock), []) == "mock-model"
