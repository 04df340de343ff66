"""The chaos report: what the load saw, what was done when, and how the gateway reacted, on one clock.

Every figure is computed from measurements of the run: the load generator's records, the timeline
of applied faults, and the gateway's `/metrics` samples. Where something was not measured (no
gateway given, a replica never ejected) the report says so instead of showing a number.

A request is placed on the timeline when its answer ended, completed or broken (the last byte
received), so a stream broken by a kill counts after the kill, not before it. A request that got
no answer (hung, or its connection failed before a byte) is placed when it was sent: nothing of
it came back to tell when it got stuck, and placing a hung one when the generator gave up would
charge it to whatever happened a timeout later.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

import numpy as np

from tidegate.chaos.process_faults import Outcome
from tidegate.chaos.runner import ChaosResult, GatewaySample, TimelineEvent, label_matches
from tidegate.loadgen.records import RequestRecord

__all__ = ["build_report", "print_report", "classify"]

_REFUSED = (429, 503)
_CONNECTION_REASONS = ("connection_error", "protocol_error")


def classify(record: RequestRecord) -> str:
    """ok | hung (no complete answer within the load's timeout) | stream_failed (an answer began, then
    broke: an error event or an empty stream) | refused (429/503) | http_error | connection_error | dropped."""
    if record.ok:
        return "ok"
    if record.reason == "timeout":
        return "hung"
    if record.reason == "dropped_inflight_cap":
        return "dropped"
    if 200 <= record.status < 300:
        return "stream_failed"
    if record.status in _REFUSED:
        return "refused"
    if record.status:
        return "http_error"
    return "connection_error"


def _placed_s(sent_s: float, record: RequestRecord) -> float:
    return sent_s + record.e2e_s if record.e2e_s is not None else sent_s


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _load_summary(points: list[tuple[float, RequestRecord]]) -> dict[str, Any]:
    counts: dict[str, int] = defaultdict(int)
    for _t, record in points:
        counts[classify(record)] += 1
    total = len(points)
    ok = [record for _t, record in points if record.ok]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": total, "ok": counts["ok"],
        "success_pct": 100.0 * counts["ok"] / total if total else None,
        "hung": counts["hung"], "streams_failed": counts["stream_failed"], "refused": counts["refused"],
        "http_errors": counts["http_error"], "connection_errors": counts["connection_error"],
        "dropped": counts["dropped"],
        "e2e_p50_s": _percentile(e2e, 50), "e2e_p99_s": _percentile(e2e, 99),
        "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
    }


def _fault_window(timeline: list[TimelineEvent], end_s: float) -> tuple[float, float] | None:
    """From the first fault applied to the last lift, when the timeline ends with one; to the end of
    the load when a fault was left in force (a kill never restarted, a proxy never set back to pass)."""
    applied = [e for e in timeline if e.outcome is Outcome.APPLIED]
    faults = [e for e in applied if not e.lifts]
    if not faults:
        return None
    last = applied[-1]
    return faults[0].t_s, max(last.t_s, faults[0].t_s) if last.lifts else max(end_s, faults[0].t_s)


def _transitions(samples: list[GatewaySample]) -> dict[str, list[tuple[float, bool]]]:
    """Per replica, each sample where its healthy gauge changed (the first sample included)."""
    changes: dict[str, list[tuple[float, bool]]] = {}
    for sample in samples:
        if sample.metric != "tidegate_replica_healthy":
            continue
        healthy = sample.value >= 0.5
        history = changes.setdefault(sample.replica, [])
        if not history or history[-1][1] != healthy:
            history.append((sample.t_s, healthy))
    return changes


def _healthy_at(history: list[tuple[float, bool]], t_s: float) -> bool | None:
    state = None
    for when, healthy in history:
        if when > t_s:
            break
        state = healthy
    return state


def _gateway_reactions(timeline: list[TimelineEvent], changes: dict[str, list[tuple[float, bool]]]) -> list[dict]:
    """For each event concerning replicas the gateway knows: how long until it ejected them (a fault)
    or took them back (a lift), read from the first sample showing the change."""
    rows = []
    for event in timeline:
        if event.outcome is not Outcome.APPLIED:
            continue
        for replica, history in changes.items():
            if not any(label_matches(replica, address) for address in event.addresses):
                continue
            wanted = event.lifts  # a lift waits for healthy, a fault for ejected
            before = _healthy_at(history, event.t_s)
            after = next((when for when, healthy in history if when >= event.t_s and healthy == wanted), None)
            if before == wanted:
                note, after_s = ("was not ejected" if wanted else "already ejected"), None
            elif after is None:
                note, after_s = ("not back by the end" if wanted else "not ejected by the end"), None
            else:
                note, after_s = ("back" if wanted else "ejected"), after - event.t_s
            rows.append({"t_s": event.t_s, "action": event.action, "replica": replica,
                         "measure": "return" if wanted else "eject", "after_s": after_s, "note": note})
    return rows


def _mean_outstanding(samples: list[GatewaySample], replicas: Iterable[str], lo: float, hi: float) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    wanted = set(replicas)
    for sample in samples:
        if sample.metric == "tidegate_replica_outstanding" and sample.replica in wanted and lo <= sample.t_s < hi:
            values[sample.replica].append(sample.value)
    return {replica: float(np.mean(v)) for replica, v in values.items()}


def _survivors(samples: list[GatewaySample], changes: dict[str, list[tuple[float, bool]]],
               timeline: list[TimelineEvent], window: tuple[float, float] | None) -> list[dict]:
    """Replicas no fault was aimed at and the gateway never ejected: their mean requests outstanding
    before and during the faults."""
    if window is None:
        return []
    aimed_at = {replica for replica in changes for event in timeline if not event.lifts
                for address in event.addresses if label_matches(replica, address)}
    survivors = [replica for replica, history in changes.items()
                 if replica not in aimed_at and all(healthy for _t, healthy in history)]
    before = _mean_outstanding(samples, survivors, -math.inf, window[0])
    during = _mean_outstanding(samples, survivors, window[0], window[1])
    return [{"replica": r, "outstanding_before": before.get(r), "outstanding_during": during.get(r),
             "ratio": during[r] / before[r] if before.get(r) and r in during else None} for r in survivors]


def _stream_failovers(samples: list[GatewaySample]) -> dict[str, int]:
    """Streams broken mid-answer by their replica during the run, by what the gateway did: resumed on
    another replica (the client saw one answer), failed (the continuation failed too), refused (not
    safe or not allowed: an error event). The counter's growth from the first sample to the last."""
    totals: dict[float, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    times = sorted({s.t_s for s in samples})
    for sample in samples:
        if sample.metric == "tidegate_stream_failovers_total":
            totals[sample.t_s][sample.outcome] += sample.value
    if not times:
        return {"resumed": 0, "failed": 0, "refused": 0}
    first, last = totals.get(times[0], {}), totals.get(times[-1], {})
    return {outcome: int(last.get(outcome, 0.0) - first.get(outcome, 0.0)) for outcome in ("resumed", "failed", "refused")}


def _per_second(points: list[tuple[float, RequestRecord]], samples: list[GatewaySample]) -> list[dict]:
    bins: dict[int, dict[str, float]] = defaultdict(lambda: {"ended": 0, "ok": 0, "failed": 0})
    for t_s, record in points:
        row = bins[int(t_s)]
        row["ended"] += 1
        row["ok" if record.ok else "failed"] += 1
    healthy: dict[int, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for sample in samples:
        if sample.metric == "tidegate_replica_healthy":
            healthy[int(sample.t_s)][sample.t_s] += sample.value
    seconds = sorted(set(bins) | set(healthy))
    return [{"second": s, **bins[s], "healthy_replicas_min": min(healthy[s].values()) if healthy[s] else None}
            for s in seconds]


def _event_windows(timeline: list[TimelineEvent], points: list[tuple[float, RequestRecord]],
                   end_s: float) -> list[dict]:
    """Each event with the requests that ended until the next one: how many failed, and for how long after it."""
    rows = []
    times = [e.t_s for e in timeline] + [end_s]
    for index, event in enumerate(timeline):
        lo, hi = times[index], max(times[index], times[index + 1])
        failed = [t for t, record in points if lo <= t < hi and not record.ok]
        ended = sum(1 for t, _r in points if lo <= t < hi)
        rows.append({"t_s": event.t_s, "planned_s": event.planned_s, "action": event.action,
                     "subject": event.subject, "outcome": event.outcome.value, "detail": event.detail,
                     "addresses": list(event.addresses), "measured": event.measured,
                     "ended_until_next": ended, "failed_until_next": len(failed),
                     "failing_for_s": (max(failed) - event.t_s) if failed else 0.0})
    return rows


def _recovery(timeline: list[TimelineEvent], points: list[tuple[float, RequestRecord]], load_end_s: float) -> dict:
    """When requests stopped failing, measured from the event before the last failure."""
    failed = [t for t, record in points if not record.ok]
    if not failed:
        return {"last_failure_s": None, "after_event": None, "after_event_s": None, "recovered_after_s": 0.0,
                "still_failing_at_end": False}
    last = failed[-1]
    before = [e for e in timeline if e.outcome is Outcome.APPLIED and e.t_s <= last]
    event = before[-1] if before else None
    still_failing = last >= load_end_s - 1.0  # a failure in the load's final second
    return {
        "last_failure_s": last,
        "after_event": f"{event.action} {event.subject}".strip() if event else None,
        "after_event_s": event.t_s if event else None,
        "recovered_after_s": None if still_failing or event is None else last - event.t_s,
        "still_failing_at_end": still_failing,
    }


def build_report(result: ChaosResult) -> dict[str, Any]:
    experiment = result.experiment
    points = sorted(((_placed_s(record.sent_s + result.record_offset_s, record), record)
                     for record in result.records), key=lambda p: p[0])
    timeline = result.timeline
    end_s = max([experiment.duration_s] + [t for t, _r in points])
    window = _fault_window(timeline, end_s + 1e-9)
    phases = {}
    if window is not None:
        phases = {
            "before": _load_summary([p for p in points if p[0] < window[0]]),
            "during": _load_summary([p for p in points if window[0] <= p[0] < window[1]]),
            "after": _load_summary([p for p in points if p[0] >= window[1]]),
        }
    load_end_s = max([experiment.duration_s] + [record.sent_s + result.record_offset_s for record in result.records])
    gateway: dict[str, Any] | None = None
    if experiment.gateway is not None:
        changes = _transitions(result.samples)
        gateway = {
            "metrics_url": experiment.gateway.metrics_url, "sample_interval_s": experiment.gateway.interval_s,
            "samples": len({s.t_s for s in result.samples}), "scrape_failures": result.scrape_failures,
            "replica_transitions": {replica: [{"t_s": t, "healthy": healthy} for t, healthy in history]
                                    for replica, history in changes.items()},
            "reactions": _gateway_reactions(timeline, changes),
            "survivors": _survivors(result.samples, changes, timeline, window),
            "stream_failovers": _stream_failovers(result.samples),
        }
    return {
        "experiment": experiment.name, "duration_s": experiment.duration_s, "load_elapsed_s": result.load_elapsed_s,
        "clock_alignment_s": result.clock_alignment_s,
        "load": experiment.load.model_dump(mode="json", exclude={"api_key"}),
        "summary": _load_summary(points), "phases": phases,
        "fault_window_s": list(window) if window else None,
        "timeline": _event_windows(timeline, points, end_s + 1e-9),
        "recovery": _recovery(timeline, points, load_end_s), "gateway": gateway, "proxies": result.proxies,
        "notes": result.notes,
        "per_second": _per_second(points, result.samples),
    }


def _fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}{unit}" if abs(value) < 1000 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def print_report(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    import sys

    # piped to a file or CI log, rich would wrap at 80 columns: the timeline needs more to stay readable
    console = console or Console(width=None if sys.stdout.isatty() else 150)
    table = Table(title=f"chaos: {report['experiment']} — load")
    for column in ("phase", "requests", "success %", "hung", "streams failed", "refused", "http errors",
                   "conn errors", "e2e p50", "e2e p99"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    rows = [("all", report["summary"])] + list(report["phases"].items())
    for phase, s in rows:  # each request in the phase in which it ended
        table.add_row(phase, str(s["requests"]), _fmt(s["success_pct"], digits=5), str(s["hung"]),
                      str(s["streams_failed"]), str(s["refused"]), str(s["http_errors"]),
                      str(s["connection_errors"]), _fmt(s["e2e_p50_s"], " s"), _fmt(s["e2e_p99_s"], " s"))
    console.print(table)
    failovers = (report["gateway"] or {}).get("stream_failovers")
    if failovers is not None:  # invisible to the load: a resumed stream is one whole answer
        console.print(f"streams broken by their replica mid-answer (gateway): {failovers['resumed']} failed over "
                      f"(resumed on another replica), {failovers['failed'] + failovers['refused']} failed "
                      f"({failovers['refused']} not continued, {failovers['failed']} whose continuation failed)")

    timeline = Table(title="faults, on the load's clock (requests counted where their answers ended)")
    for column in ("t (s)", "planned", "action", "subject", "outcome", "detail", "failed/ended until next",
                   "failing for"):
        timeline.add_column(column)
    for row in report["timeline"]:
        timeline.add_row(f"{row['t_s']:.2f}", _fmt(row["planned_s"]), row["action"], row["subject"], row["outcome"],
                         row["detail"], f"{row['failed_until_next']}/{row['ended_until_next']}",
                         _fmt(row["failing_for_s"], " s"))
    console.print(timeline)

    gateway = report["gateway"]
    if gateway is not None:
        reactions = Table(title=f"gateway reactions (sampled every {gateway['sample_interval_s']:g} s)")
        for column in ("t (s)", "action", "replica", "measure", "after", "note"):
            reactions.add_column(column)
        for row in gateway["reactions"]:
            reactions.add_row(f"{row['t_s']:.2f}", row["action"], row["replica"], row["measure"],
                              _fmt(row["after_s"], " s"), row["note"])
        console.print(reactions)
        if gateway["survivors"]:
            survivors = Table(title="load on survivors (mean requests outstanding)")
            for column in ("replica", "before faults", "during faults", "ratio"):
                survivors.add_column(column)
            for row in gateway["survivors"]:
                survivors.add_row(row["replica"], _fmt(row["outstanding_before"]), _fmt(row["outstanding_during"]),
                                  _fmt(row["ratio"]))
            console.print(survivors)
    recovery = report["recovery"]
    if recovery["last_failure_s"] is None:
        console.print("recovery: no request failed")
    elif recovery["still_failing_at_end"]:
        console.print(f"recovery: none: requests were still failing at the end of the load "
                      f"(the last ended at {recovery['last_failure_s']:.2f} s)")
    else:
        after = (f"{recovery['recovered_after_s']:.2f} s after {recovery['after_event']} at "
                 f"{recovery['after_event_s']:.2f} s" if recovery["after_event"] else "before any fault")
        console.print(f"recovery: the last failed request ended at {recovery['last_failure_s']:.2f} s, {after}; "
                      f"none failed after it")
    for name, counters in report["proxies"].items():
        shown = {k: v for k, v in counters.items() if k != "connections_open"}
        console.print(f"proxy {name}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in shown.items()))
    for note in report["notes"]:
        console.print(f"note: {note}")
