"""The Grafana dashboard, built from code: `python -m tidegate.telemetry.dashboard > deploy/grafana/tidegate.json`.

Panels are declared once here, as PromQL over the metrics the gateway and its engines export; the
JSON model (Grafana 11, schema 39) is derived from them, and `tests/deploy/test_dashboard.py` checks
that the committed file is this module's output, that its structure is one Grafana imports, and,
against a real Prometheus scraping a live gateway under load, that every query parses and returns
data. Plain dictionaries rather than `grafana-foundation-sdk`: its Python release tracks Grafana's
schema with pre-release version numbers, and what is built here is six rows of time series.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

__all__ = ["Query", "Panel", "Row", "ROWS", "queries", "build"]

RATE = "$__rate_interval"
POOL = 'pool=~"$pool"'


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str  # a Grafana unit id: reqps, s, percentunit, short, ...
    queries: tuple[Query, ...]
    description: str = ""


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _p(title: str, unit: str, *queries: tuple[str, str], description: str = "") -> Panel:
    return Panel(title, unit, tuple(Query(expr, legend) for expr, legend in queries), description)


def _quantile(q: float, metric: str, by: str, selector: str = POOL) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}[{RATE}])))"


ROWS: tuple[Row, ...] = (
    Row("Traffic", (
        _p("Requests answered, by status", "reqps",
           (f"sum by (status) (rate(tidegate_requests_total{{{POOL}}}[{RATE}]))", "{{status}}")),
        _p("Arrivals by admission outcome", "reqps",
           (f"sum by (outcome) (rate(tidegate_overload_admissions_total{{{POOL}}}[{RATE}]))", "{{outcome}}"),
           description="queued (served, at once or after a wait), preset_reply, fallback_pool, rate_limited, "
                       "too_large"),
        _p("Requests in flight", "short", (f"sum by (pool) (tidegate_requests_in_flight{{{POOL}}})", "{{pool}}")),
        _p("Engine tokens per second", "short",
           (f"sum(rate(tidegate_engine_prompt_tokens_total[{RATE}]))", "prompt"),
           (f"sum(rate(tidegate_engine_generation_tokens_total[{RATE}]))", "generated")),
    )),
    Row("Latency by tier, against targets", (
        _p("Time to first token P99 by tier, and its target", "s",
           (_quantile(0.99, "tidegate_overload_time_to_first_token_seconds", "tier"), "P99 {{tier}}"),
           ("max by (tier) (tidegate_tier_ttft_target_seconds)", "target {{tier}}")),
        _p("Time to first token P50 by tier", "s",
           (_quantile(0.5, "tidegate_overload_time_to_first_token_seconds", "tier"), "P50 {{tier}}")),
        _p("First tokens within their tier's target", "percentunit",
           (f'sum by (tier) (rate(tidegate_overload_first_tokens_total{{{POOL}, outcome="within_target"}}[{RATE}]))'
            f" / sum by (tier) (rate(tidegate_overload_first_tokens_total{{{POOL}}}[{RATE}]))", "{{tier}}"),
           description="The latency SLO's good events (alerts: TidegateLatencySLO*Burn)"),
        _p("Request duration P99 by pool", "s",
           (_quantile(0.99, "tidegate_request_duration_seconds", "pool"), "{{pool}}")),
        _p("Engine inter-token gap P99", "s",
           (_quantile(0.99, "tidegate_engine_inter_token_seconds", "instance", ""), "{{instance}}")),
    )),
    Row("Overload: queues, refusals, degradation", (
        _p("Queued by tier", "short", (f"sum by (tier) (tidegate_overload_queue_depth{{{POOL}}})", "{{tier}}")),
        _p("Oldest wait by tier", "s",
           (f"max by (tier) (tidegate_overload_queue_oldest_wait_seconds{{{POOL}}})", "{{tier}}")),
        _p("Queue wait P90 by tier (dispatched requests)", "s",
           (_quantile(0.9, "tidegate_overload_queue_wait_seconds", "tier"), "{{tier}}")),
        _p("Refused or shed, by reason", "reqps",
           (f"sum by (reason) (rate(tidegate_overload_rejections_total{{{POOL}}}[{RATE}]))", "{{reason}}")),
        _p("Degraded answers by rung", "reqps",
           (f"sum by (rung) (rate(tidegate_overload_degraded_responses_total{{{POOL}}}[{RATE}]))", "{{rung}}")),
        _p("Refusal answer time P99", "s",
           (_quantile(0.99, "tidegate_overload_rejection_seconds", "pool"), "{{pool}}")),
        _p("Tenants over their fair share", "short",
           (f"sum by (tier) (tidegate_overload_tenants_over_share{{{POOL}}})", "{{tier}}")),
    )),
    Row("Replicas: health, work budgets, engine load", (
        _p("Replicas taking traffic", "short", (f"sum by (pool) (tidegate_replica_healthy{{{POOL}}})", "{{pool}}")),
        _p("Requests held by replica", "short",
           (f"sum by (replica) (tidegate_replica_outstanding{{{POOL}}})", "{{replica}}")),
        _p("Work budget by replica (prefill tokens ahead of a best-tier request)", "short",
           (f"max by (replica) (tidegate_replica_work_budget_tokens{{{POOL}}})", "{{replica}}")),
        _p("Fitted engine seconds per prefill token", "s",
           (f'max by (replica) (tidegate_replica_ttft_fit_seconds{{{POOL}, coefficient="per_token"}})',
            "{{replica}}")),
        _p("Engine busy fraction", "percentunit",
           (f"rate(tidegate_engine_busy_seconds_total[{RATE}])", "{{instance}}"),
           description="Share of wall time in model steps: the utilisation of TidegateReplicaSaturated"),
        _p("Engine sequences", "short",
           ("sum by (instance) (tidegate_engine_running_sequences)", "running {{instance}}"),
           ("sum by (instance) (tidegate_engine_waiting_sequences)", "waiting {{instance}}")),
        _p("Engine KV cache in use", "percentunit", ("max by (instance) (tidegate_engine_kv_cache_usage)", "{{instance}}")),
        _p("Engine batch per step P50", "short",
           (_quantile(0.5, "tidegate_engine_step_batch_size", "instance", ""), "{{instance}}")),
    )),
    Row("Cache", (
        _p("Response cache, by outcome", "reqps",
           (f"sum by (result) (rate(tidegate_response_cache_requests_total{{{POOL}}}[{RATE}]))", "{{result}}"),
           description="hit_memory, hit_redis, hit_semantic, coalesced (joined an identical request in flight), "
                       "miss (went to a replica and was stored), bypass (not cacheable)"),
        _p("Requests kept off the engines", "percentunit",
           (f'sum by (pool) (rate(tidegate_response_cache_requests_total{{{POOL}, result=~"hit.*|coalesced"}}'
            f"[{RATE}])) / sum by (pool) (rate(tidegate_response_cache_requests_total{{{POOL}}}[{RATE}]))",
            "{{pool}}")),
        _p("Memory tier held", "bytes", ("sum by (instance) (tidegate_response_cache_memory_bytes)", "{{instance}}")),
        _p("Redis tier up", "short", ("min by (instance) (tidegate_response_cache_redis_up)", "{{instance}}"),
           description="0: the gateway serves without Redis (alert TidegateCacheRedisDown after 5 minutes)"),
        _p("Semantic lookups, by result", "reqps",
           (f"sum by (result) (rate(tidegate_semantic_cache_lookups_total{{{POOL}}}[{RATE}]))", "{{result}}")),
    )),
    Row("Scaling", (
        _p("Replicas: desired by the autoscaler, and ready", "short",
           (f"max by (pool) (tidegate_desired_replicas{{{POOL}}})", "desired {{pool}}"),
           (f"max by (pool) (tidegate_replicas_ready{{{POOL}}})", "ready {{pool}}"),
           description="Pools with `autoscale` configured; the HPA or KEDA follows desired"),
        _p("Scaling decisions by layer", "short",
           (f"sum by (layer) (increase(tidegate_autoscale_decisions_total{{{POOL}}}[{RATE}]))", "{{layer}}")),
    )),
    Row("Failures", (
        _p("Upstream errors by kind", "reqps",
           (f"sum by (kind) (rate(tidegate_upstream_errors_total{{{POOL}}}[{RATE}]))", "{{kind}}")),
        _p("Retries on another replica", "reqps",
           (f"sum by (reason) (rate(tidegate_upstream_retries_total{{{POOL}}}[{RATE}]))", "{{reason}}")),
        _p("Requests refused before any pool (auth, bad body, unknown model)", "reqps",
           (f"sum by (status) (rate(tidegate_unrouted_requests_total[{RATE}]))", "{{status}}")),
        _p("Client connections open", "short", ("sum(tidegate_client_connections_open)", "open")),
    )),
)


def queries() -> list[str]:
    """Every panel's PromQL, in order."""
    return [query.expr for row in ROWS for panel in row.panels for query in panel.queries]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": {"lineWidth": 1, "fillOpacity": 10}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + index), "expr": query.expr, "legendFormat": query.legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for index, query in enumerate(panel.queries)],
    }


def build() -> dict:
    """The dashboard's JSON model: a row per `Row`, three panels abreast."""
    panels: list[dict] = []
    panel_id, y = 1, 0
    for row in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for index, panel in enumerate(row.panels):
            panels.append(_panel_json(panel, panel_id, 8 * (index % 3), y + 8 * (index // 3)))
            panel_id += 1
        y += 8 * ((len(row.panels) + 2) // 3)
    return {
        "uid": "tidegate", "title": "tidegate", "tags": ["tidegate", "llm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "pool", "type": "query", "label": "Pool", "includeAll": True, "multi": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(tidegate_requests_total, pool)", "refId": "pools"},
             "definition": "label_values(tidegate_requests_total, pool)", "refresh": 2},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
