"""The gateway's live status page: `GET /status` (HTML, refreshing itself) and `GET /status.json`.

Server-rendered, no script and no external asset (a CDN may be unreachable, or unwanted, where the
gateway runs): a `<meta http-equiv="refresh">` reloads it. It shows what an operator asks first
in a surge: per pool, each replica's health, breaker, requests held and engine load, the queue per
tier, time to first token by tier against its target over the last minute, and refusals and
degraded answers. Replicas appear by id (host:port), never with an upstream's key or a URL's
credentials; access is that of `/metrics`.

Figures come from the same objects `/metrics` reads (the gateway's registry, the pools, the
controllers), so the page and a scrape agree; each figure carries a `data-metric` attribute naming
its metric and labels, which is how the browser test reads it back.
"""

from __future__ import annotations

import html
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from tidegate.gateway.overload_metrics import Buckets, bucket_increase, quantile_from_buckets
from tidegate.policy.health import is_routable

__all__ = ["StatusPage"]

WINDOW_S = 60.0  # TTFT percentiles over about the last minute
REFRESH_S = 2


@dataclass
class _Histograms:
    """Cumulative bucket counts by label set, as read at one time."""

    taken_s: float
    counts: dict[tuple[str, str], Buckets] = field(default_factory=dict)


def _read_samples(registry: CollectorRegistry, name: str) -> list[Any]:
    return [sample for family in registry.collect() if family.name == name for sample in family.samples]


class StatusPage:
    """Builds the page from the running gateway; `render` keeps a short history of histogram reads
    (the state it changes) to give last-minute percentiles."""

    def __init__(self, registry: CollectorRegistry, pools: Mapping[str, Any], overload: Any | None,
                 clock: Callable[[], float] = time.monotonic, scaling: Any | None = None) -> None:
        self._registry = registry
        self._pools = pools
        self._overload = overload
        self._scaling = scaling  # gateway.scaling.ScaleLoop, when a pool autoscales
        self._clock = clock
        self._history: deque[_Histograms] = deque()

    # ---- the figures -------------------------------------------------------------------------

    def snapshot(self, now_s: float, ttft: Mapping[tuple[str, str], Buckets]) -> dict:
        """Everything the page shows, as plain data (also `/status.json`)."""
        pools = []
        for name, pool in self._pools.items():
            body = self._overload.bodies.get(name) if self._overload is not None else None
            controller = body.controller if body is not None else None
            replicas = [{
                "replica": replica.replica_id,
                "routable": is_routable(replica.health, replica.breaker, now_s),
                "health": replica.health.value,
                "breaker": replica.breaker.state.value,
                "outstanding": replica.outstanding,
                "slot_limit": replica.slot_limit,
                "work_budget_tokens": (controller.budget_tokens(now_s, replica.replica_id)
                                       if controller is not None else None),
                "running_sequences": replica.load.running_sequences,
                "waiting_sequences": replica.load.waiting_sequences,
                "kv_cache_usage": replica.load.kv_cache_usage,
            } for replica in pool.replicas]
            tiers = []
            if self._overload is not None:
                for tier in self._overload.control.tiers:
                    buckets = ttft.get((name, tier.name), [])
                    tiers.append({
                        "tier": tier.name, "target_s": tier.ttft_target_s,
                        "queued": controller.queue_depth(tier.name) if controller is not None else 0,
                        "ttft_p50_s": quantile_from_buckets(0.5, buckets),
                        "ttft_p99_s": quantile_from_buckets(0.99, buckets),
                        "first_tokens": buckets[-1][1] if buckets else 0.0,
                    })
            scaling = [{"seconds_ago": now_s - record.at_s, "ready": record.ready, "desired": record.desired,
                        "layer": record.layer, "reason": record.reason}
                       for record in reversed(self._scaling.history(name))] if self._scaling is not None else []
            pools.append({"pool": name, "queued": len(pool.queue) if controller is None else controller.queued,
                          "replicas": replicas, "tiers": tiers, "scaling": scaling})
        return {"pools": pools, "window_s": WINDOW_S,
                "answered": self._totals("tidegate_requests_total", "pool", "status"),
                "refused": self._totals("tidegate_overload_rejections_total", "pool", "reason"),
                "degraded": self._totals("tidegate_overload_degraded_responses_total", "pool", "rung")}

    def _totals(self, sample_name: str, *labels: str) -> list[dict]:
        return [{**{label: sample.labels[label] for label in labels}, "count": sample.value}
                for sample in _read_samples(self._registry, sample_name.removesuffix("_total"))
                if sample.name == sample_name]

    def _read_ttft(self, now_s: float) -> _Histograms:
        return _Histograms(now_s, self._overload.metrics.first_tokens.cumulative() if self._overload is not None else {})

    def _recent_ttft(self, now_s: float) -> dict[tuple[str, str], Buckets]:
        """Bucket counts since the oldest read kept (about `WINDOW_S` ago); records this read."""
        current = self._read_ttft(now_s)
        history = self._history
        while len(history) > 1 and now_s - history[1].taken_s >= WINDOW_S:
            history.popleft()
        base = history[0] if history and now_s - history[0].taken_s >= 1.0 else None
        if not history or now_s - history[-1].taken_s >= 1.0:
            history.append(current)
        if base is None:
            return current.counts
        return {key: bucket_increase(buckets, base.counts.get(key, [])) for key, buckets in current.counts.items()}

    # ---- the page ----------------------------------------------------------------------------

    def render(self) -> tuple[bytes, dict]:
        now_s = self._clock()
        snapshot = self.snapshot(now_s, self._recent_ttft(now_s))
        return _html(snapshot).encode(), snapshot


def _num(value: Any, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if unit == "ms":
        return f"{value * 1000:.0f} ms"
    if unit == "%":
        return f"{value * 100:.0f} %"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def _cell(value: Any, metric: str, labels: Mapping[str, str], unit: str = "", css: str = "") -> str:
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    raw = "" if value is None or (isinstance(value, float) and math.isnan(value)) else repr(value)
    return (f'<td class="{css}" data-metric="{html.escape(metric)}{{{html.escape(label_text)}}}" '
            f'data-value="{html.escape(raw)}">{html.escape(_num(value, unit))}</td>')


def _ttft_bar(p99_s: float, target_s: float) -> str:
    """An inline SVG bar: P99 against the target (the line at 80 % of the width)."""
    width = 160
    if math.isnan(p99_s):
        filled = 0.0
    else:
        filled = min(1.0, p99_s / (1.25 * target_s)) * width
    colour = "#2e7d32" if math.isnan(p99_s) or p99_s <= target_s else "#c62828"
    mark = 0.8 * width
    return (f'<svg width="{width}" height="12" role="img"><rect width="{width}" height="12" fill="#eee"/>'
            f'<rect width="{filled:.1f}" height="12" fill="{colour}"/>'
            f'<line x1="{mark:.0f}" x2="{mark:.0f}" y1="0" y2="12" stroke="#000"/></svg>')


def _table(headers: Iterable[str], rows: Iterable[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _html(snapshot: dict) -> str:
    sections = []
    for pool in snapshot["pools"]:
        name = pool["pool"]
        replica_rows = [
            "<tr>" + f"<td>{html.escape(r['replica'])}</td>"
            + _cell(1 if r["routable"] else 0, "tidegate_replica_healthy", {"pool": name, "replica": r["replica"]},
                    css="ok" if r["routable"] else "bad")
            + f"<td>{html.escape(r['health'])} / {html.escape(r['breaker'])}</td>"
            + _cell(r["outstanding"], "tidegate_replica_outstanding", {"pool": name, "replica": r["replica"]})
            + f"<td>{r['slot_limit']}</td>"
            + _cell(r["work_budget_tokens"], "tidegate_replica_work_budget_tokens",
                    {"pool": name, "replica": r["replica"]})
            + f"<td>{r['running_sequences']} + {r['waiting_sequences']}</td>"
            + f"<td>{_num(r['kv_cache_usage'], '%')}</td></tr>"
            for r in pool["replicas"]]
        tier_rows = [
            "<tr>" + f"<td>{html.escape(t['tier'])}</td>"
            + _cell(t["queued"], "tidegate_overload_queue_depth", {"pool": name, "tier": t["tier"]})
            + _cell(t["ttft_p50_s"], "ttft_p50", {"pool": name, "tier": t["tier"]}, "ms")
            + _cell(t["ttft_p99_s"], "ttft_p99", {"pool": name, "tier": t["tier"]}, "ms")
            + f"<td>{t['target_s']:g} s</td><td>{_ttft_bar(t['ttft_p99_s'], t['target_s'])}</td>"
            + _cell(t["first_tokens"], "first_tokens", {"pool": name, "tier": t["tier"]}) + "</tr>"
            for t in pool["tiers"]]
        sections.append(
            f'<section><h2>Pool {html.escape(name)}</h2>'
            f'<p>waiting in the gateway: <b data-metric="queued{{pool=&quot;{html.escape(name)}&quot;}}" '
            f'data-value="{pool["queued"]}">{pool["queued"]}</b></p>'
            + _table(("replica", "takes traffic", "health / breaker", "requests held", "slot limit",
                      "work budget (tokens)", "engine running + waiting", "KV cache"), replica_rows)
            + (_table(("tier", "queued", "TTFT P50", "TTFT P99", "target", "P99 against target (line)",
                       "first tokens"), tier_rows) if tier_rows else "")
            + (_table(("scaling decision", "ready then", "desired", "layer", "why"), [
                f"<tr><td>{d['seconds_ago']:.0f} s ago</td><td>{d['ready']}</td><td>{d['desired']}</td>"
                f"<td>{html.escape(d['layer'])}</td><td>{html.escape(d['reason'])}</td></tr>"
                for d in pool["scaling"][:8]]) if pool["scaling"] else "")
            + "</section>")

    def counts(title: str, rows: list[dict], metric: str, label: str) -> str:
        body = ["<tr>" + f"<td>{html.escape(row['pool'])}</td><td>{html.escape(row[label])}</td>"
                + _cell(row["count"], metric, {"pool": row["pool"], label: row[label]}) + "</tr>"
                for row in sorted(rows, key=lambda r: (r["pool"], r[label]))] or ['<tr><td colspan="3">none yet</td></tr>']
        return f"<section><h2>{html.escape(title)}</h2>" + _table(("pool", label, "since start"), body) + "</section>"

    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="refresh" content="{REFRESH_S}"><title>tidegate status</title><style>'
        "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1em}"
        "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}"
        "td:first-child{text-align:left}.ok{color:#2e7d32}.bad{color:#c62828;font-weight:bold}"
        "</style></head><body><h1>tidegate</h1>"
        f"<p>Time to first token over the last {snapshot['window_s']:.0f} s; the page reloads every {REFRESH_S} s.</p>"
        + "".join(sections)
        + counts("Answers by status", snapshot["answered"], "tidegate_requests_total", "status")
        + counts("Refused or shed, by reason", snapshot["refused"], "tidegate_overload_rejections_total", "reason")
        + counts("Degraded answers, by rung", snapshot["degraded"], "tidegate_overload_degraded_responses_total",
                 "rung")
        + "</body></html>")
