"""`tidegate report`: per-tier SLOs in a report, plots on one timeline, and two reports compared."""

from __future__ import annotations

import json

import orjson
import pytest

from tidegate.cli import main
from tidegate.loadgen.driver import MetricSample, RunResult
from tidegate.loadgen.report import build_report, write_report
from tidegate.loadgen.report_cli import compare_rows, load_report
from tidegate.loadgen.stats import Slo, timeline
from tests.loadgen.records_factory import make_record

TIER_SLOS = {"critical": Slo(ttft_s=0.2), "sheddable": Slo(ttft_s=2.0)}


def _result(ttft_s: float, refused_every: int = 0) -> RunResult:
    records = []
    for i in range(40):
        tier = "critical" if i % 2 else "sheddable"
        if refused_every and i % refused_every == 0:
            records.append(make_record(i, tier=tier, status=503, reason="overloaded", ttft_s=None, e2e_s=None,
                                       sent_s=i * 0.1, scheduled_s=i * 0.1))
        else:
            records.append(make_record(i, tier=tier, ttft_s=ttft_s, sent_s=i * 0.1, scheduled_s=i * 0.1))
    metrics = [MetricSample(float(t), 0, f'tidegate_replica_outstanding{{pool="p",replica="r{r}"}}', float(t + r))
               for t in range(4) for r in range(2)]
    metrics += [MetricSample(float(t), 0, 'tidegate_queue_depth{pool="p"}', 2.0) for t in range(4)]
    return RunResult(records=records, metrics=metrics, started_at_unix=1.0, elapsed_s=4.0, connections_opened=1,
                     peak_in_flight=4)


def _report(ttft_s: float, refused_every: int = 0) -> dict:
    return build_report(_result(ttft_s, refused_every), config={}, slo=Slo(), targets=1, lag_threshold_ms=10.0,
                        tier_slos=TIER_SLOS, target_names=["live"])


def test_each_tier_is_judged_by_its_own_target() -> None:
    report = _report(ttft_s=0.5)  # misses critical's 200 ms, meets sheddable's 2 s
    good = {s["tier"]: s["good"] for s in report["summaries"]}
    assert good == {"all": 20, "critical": 0, "sheddable": 20}
    assert {t["name"]: t["ttft_target_ms"] for t in report["tiers"]} == {"critical": 200.0, "sheddable": 2000.0}
    assert report["targets"] == ["live"]


def test_timeline_has_ttft_percentiles_per_tier() -> None:
    records = [make_record(0, tier="a", ttft_s=0.1, sent_s=0.2), make_record(1, tier="b", ttft_s=0.3, sent_s=0.4)]
    bucket = timeline(records)[0]
    assert bucket["ttft_by_tier"] == {"a": [pytest.approx(100.0), pytest.approx(100.0)],
                                      "b": [pytest.approx(300.0), pytest.approx(300.0)]}


def test_compare_gives_each_tiers_figures_and_their_ratio() -> None:
    rows = compare_rows(_report(ttft_s=0.1), _report(ttft_s=0.3, refused_every=4))
    by = {(r["tier"], r["figure"]): r for r in rows}
    assert [r["tier"] for r in rows][0] == "all"
    assert by[("critical", "TTFT p50 ms")]["ratio"] == pytest.approx(3.0)
    assert by[("all", "refused")]["a"] == 0 and by[("all", "refused")]["b"] == 10
    assert by[("all", "served")]["ratio"] == pytest.approx(0.75)
    assert by[("critical", "goodput/s")]["b"] == 0  # 300 ms misses critical's 200 ms target


def test_report_commands_draw_plots_and_write_the_comparison(tmp_path, capsys) -> None:
    for name, ttft_s in (("a", 0.1), ("b", 0.3)):
        write_report(_report(ttft_s), _result(ttft_s), tmp_path / name)
    a, b = (str(tmp_path / name / "report.json") for name in "ab")
    assert main(["report", "show", a, "--out", str(tmp_path / "plots")]) == 0
    assert all((tmp_path / "plots" / f).stat().st_size > 0 for f in ("latency.png", "load.png", "replicas.png",
                                                                       "timeline.png"))
    assert main(["report", "compare", a, b, "--label-a", "live", "--label-b", "sim", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "live" in out and "sim" in out and "3.000" in out
    compared = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert compared["label_b"] == "sim" and compared["rows"]
    assert (tmp_path / "c" / "compare.png").stat().st_size > 0


def test_a_file_that_is_not_a_report_is_a_clear_error(tmp_path, capsys) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(orjson.dumps({"schema": "something/9"}))
    assert main(["report", "show", str(path)]) == 2
    assert "not a report" in capsys.readouterr().err
    assert main(["report", "compare", str(path), str(tmp_path / "missing.json")]) == 2
    with pytest.raises(ValueError):
        load_report(path)
