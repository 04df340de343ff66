"""The bench report: a versioned JSON document, per-request records, and the terminal table.

report.json (schema "tidegate.bench.report/1"):
  schema          "tidegate.bench.report/1"
  created_unix    float, when the run started
  config          the command line as a mapping (targets, arrivals, mix, SLOs, ...)
  targets         what each target index names (a URL, or a simulated arm such as "FIFO")
  tiers           [{name, ttft_target_ms, tpot_target_ms}]: the tiers' own SLOs, when known (from a
                  `tidegate serve` config); a tier's requests are judged by its SLO, others by the
                  command line's
  credits         list of strings (e.g. the trace's credit when a trace was replayed)
  elapsed_s       first send to last completion
  connections_opened  TCP connections the generator opened
  peak_in_flight  most requests in flight at once
  schedule_lag    {p50_ms, p90_ms, p99_ms, max_ms, late_count, threshold_ms, behind_schedule}
  warnings        list of strings (behind schedule, drops, ...)
  summaries       list of group summaries, one per (target, tier) plus tier "all" per target:
                  {target, tier, requests, succeeded, dropped, degraded, statuses{}, reasons{},
                   ttft{count,mean_ms,p50_ms,p90_ms,p99_ms,max_ms}, itl{..}, tpot{..}, e2e{..},
                   throughput_rps, output_tokens_per_s, mean_prompt_tokens_target,
                   mean_prompt_tokens_reported, good, goodput_rps, slo_attainment_pct}
  comparison      null, or {ratios: {metric: target1 / target0}} for --compare runs
  phases          [] or, for scenarios, [{name, start_s, end_s, summaries: [...]}]: the same group
                  summaries over requests *sent* in each phase (e.g. before / surge / after)
  timeline        per target: list of per-second buckets (see stats.timeline)
  metrics         scraped samples [{t_s, target, series, value}]
  records_file    "records.jsonl": one RequestRecord.to_json() per line
Adding fields keeps the version; renaming or removing one bumps it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import orjson

from tidegate.loadgen.driver import RunResult
from tidegate.loadgen.records import RequestRecord
from tidegate.loadgen.stats import GroupSummary, Slo, lag_summary, summarize, timeline

__all__ = ["SCHEMA", "REQUIRED_KEYS", "build_report", "write_report", "print_summary"]

SCHEMA = "tidegate.bench.report/1"
Phase = tuple[str, float, float]  # name, start_s, end_s (by scheduled send time)
REQUIRED_KEYS = (
    "schema", "created_unix", "config", "targets", "tiers", "credits", "elapsed_s", "connections_opened", "peak_in_flight",
    "schedule_lag",
    "warnings", "summaries", "comparison", "phases", "timeline", "metrics", "records_file",
)
# Ratios reported for --compare: (summary path, name)
_COMPARED = (
    ("ttft.p50_ms", "ttft_p50"), ("ttft.p99_ms", "ttft_p99"), ("itl.p50_ms", "itl_p50"),
    ("itl.p99_ms", "itl_p99"), ("e2e.p50_ms", "e2e_p50"), ("e2e.p99_ms", "e2e_p99"),
    ("throughput_rps", "throughput_rps"), ("output_tokens_per_s", "output_tokens_per_s"),
    ("goodput_rps", "goodput_rps"),
)


def _lookup(summary: dict, path: str) -> Any:
    value: Any = summary
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _summaries(records: Sequence[RequestRecord], slo: Slo, tier_slos: Mapping[str, Slo], targets: int,
               elapsed_s: float) -> list[GroupSummary]:
    groups: list[GroupSummary] = []
    for target in range(targets):
        mine = [r for r in records if r.target == target]
        groups.append(summarize(mine, target=target, tier="all", elapsed_s=elapsed_s, slo=slo, tier_slos=tier_slos))
        for tier in sorted({r.tier for r in mine}):
            tiered = [r for r in mine if r.tier == tier]
            groups.append(summarize(tiered, target=target, tier=tier, elapsed_s=elapsed_s, slo=slo,
                                    tier_slos=tier_slos))
    return groups


def _phases(result: RunResult, phases: Sequence[Phase], slo: Slo, tier_slos: Mapping[str, Slo],
            targets: int) -> list[dict[str, Any]]:
    out = []
    for name, start_s, end_s in phases:
        sent_in = [r for r in result.records if start_s <= r.scheduled_s < end_s]
        span = max(min(end_s, result.elapsed_s) - start_s, 1e-9)
        summaries = _summaries(sent_in, slo, tier_slos, targets, span)
        out.append({"name": name, "start_s": start_s, "end_s": end_s,
                    "summaries": [dataclasses.asdict(s) for s in summaries]})
    return out


def _ms_or_none(value_s: float | None) -> float | None:
    return None if value_s is None else value_s * 1000


def build_report(
    result: RunResult,
    *,
    config: dict[str, Any],
    slo: Slo,
    targets: int,
    lag_threshold_ms: float,
    credits: Sequence[str] = (),
    open_loop: bool = True,
    phases: Sequence[Phase] = (),
    tier_slos: Mapping[str, Slo] | None = None,
    target_names: Sequence[str] = (),
) -> dict[str, Any]:
    tier_slos = dict(tier_slos or {})
    summaries = [dataclasses.asdict(s) for s in _summaries(result.records, slo, tier_slos, targets, result.elapsed_s)]
    lag = lag_summary(result.records, lag_threshold_ms)
    warnings: list[str] = []
    if open_loop and lag.behind_schedule:
        warnings.append(
            f"generator fell behind its schedule: p99 send lag {lag.p99_ms:.1f} ms > {lag_threshold_ms:g} ms "
            f"({lag.late_count} requests late); the offered load was lower than asked"
        )
    dropped = sum(s["dropped"] for s in summaries if s["tier"] == "all")
    if dropped:
        warnings.append(f"{dropped} requests dropped at the --max-inflight cap (not sent)")
    comparison = None
    if targets == 2:
        base, other = (next(s for s in summaries if s["target"] == t and s["tier"] == "all") for t in (0, 1))
        ratios = {}
        for path, name in _COMPARED:
            a, b = _lookup(base, path), _lookup(other, path)
            ratios[name] = (b / a) if a and b is not None else None
        comparison = {"ratios": ratios, "note": "target 1 / target 0, interleaved request by request"}
    return {
        "schema": SCHEMA,
        "created_unix": result.started_at_unix,
        "config": config,
        "targets": list(target_names) or [f"target {t}" for t in range(targets)],
        "tiers": [{"name": name, "ttft_target_ms": _ms_or_none(tier_slo.ttft_s),
                   "tpot_target_ms": _ms_or_none(tier_slo.tpot_s)} for name, tier_slo in tier_slos.items()],
        "credits": list(credits),
        "elapsed_s": result.elapsed_s,
        "connections_opened": result.connections_opened,
        "peak_in_flight": result.peak_in_flight,
        "schedule_lag": dataclasses.asdict(lag),
        "warnings": warnings,
        "summaries": summaries,
        "comparison": comparison,
        "phases": _phases(result, phases, slo, tier_slos, targets),
        "timeline": [timeline([r for r in result.records if r.target == t]) for t in range(targets)],
        "metrics": [dataclasses.asdict(m) for m in result.metrics],
        "records_file": "records.jsonl",
    }


def write_report(report: dict[str, Any], result: RunResult, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    with open(out_dir / report["records_file"], "wb") as handle:
        for record in result.records:
            handle.write(orjson.dumps(record.to_json()) + b"\n")
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(title: str, summaries: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("target", "tier", "reqs", "ok", "429", "503", "other err", "degraded", "TTFT p50/p99 ms",
                   "ITL p50/p99 ms", "E2E p99 ms", "ok/s", "tok/s", "goodput/s", "SLO %"):
        table.add_column(column, justify="right")
    for s in summaries:
        statuses = s["statuses"]
        other = s["requests"] - s["succeeded"] - statuses.get("429", 0) - statuses.get("503", 0)
        table.add_row(
            str(s["target"]), s["tier"], str(s["requests"]), str(s["succeeded"]), str(statuses.get("429", 0)),
            str(statuses.get("503", 0)), str(other), str(s["degraded"]),
            f"{_ms(s['ttft']['p50_ms'])}/{_ms(s['ttft']['p99_ms'])}",
            f"{_ms(s['itl']['p50_ms'])}/{_ms(s['itl']['p99_ms'])}", _ms(s["e2e"]["p99_ms"]),
            f"{s['throughput_rps']:.1f}", f"{s['output_tokens_per_s']:.0f}",
            "-" if s["goodput_rps"] is None else f"{s['goodput_rps']:.1f}",
            "-" if s["slo_attainment_pct"] is None else f"{s['slo_attainment_pct']:.1f}",
        )
    return table


def print_summary(report: dict[str, Any], console=None) -> None:
    from rich.console import Console

    # wide enough for every column when piped to a file (rich assumes 80 otherwise)
    console = console or Console(width=None if sys.stdout.isatty() else 180)
    names = report.get("targets") or []
    title = "tidegate bench" + ("" if len(names) < 2 else ": " + ", ".join(f"target {i} = {n}" for i, n in enumerate(names)))
    console.print(_table(title, report["summaries"]))
    for phase in report["phases"]:
        console.print(_table(f"phase {phase['name']}: sent in [{phase['start_s']:g}, {phase['end_s']:g}) s",
                             phase["summaries"]))
    lag = report["schedule_lag"]
    console.print(f"schedule lag p50/p99/max: {_ms(lag['p50_ms'])}/{_ms(lag['p99_ms'])}/{_ms(lag['max_ms'])} ms; "
                  f"elapsed {report['elapsed_s']:.1f} s; connections {report['connections_opened']}; "
                  f"peak in flight {report['peak_in_flight']}")
    for s in report["summaries"]:
        if s["tier"] == "all" and s["reasons"]:
            top = sorted(s["reasons"].items(), key=lambda item: -item[1])[:5]
            console.print(f"target {s['target']} failures: " + ", ".join(f"{reason} {count}" for reason, count in top))
    overall = next((s for s in report["summaries"] if s["tier"] == "all"), None)
    if overall and overall["mean_prompt_tokens_reported"] is not None:
        # synthetic prompts are sized in bytes (1 token per byte for a byte-level tokenizer); the
        # server's usage says what its tokenizer and chat template made of them
        console.print(f"prompt tokens: asked {overall['mean_prompt_tokens_target']:.0f} on average, "
                      f"server reported {overall['mean_prompt_tokens_reported']:.0f}")
    if report["comparison"]:
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in report["comparison"]["ratios"].items() if v is not None)
        console.print(f"compare (target 1 / target 0): {ratios}")
    for warning in report["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    for credit in report["credits"]:
        console.print(f"trace: {credit}")
