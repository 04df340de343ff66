"""Prometheus metrics of overload control, registered on the gateway's registry.

Queue depth and oldest wait per tier and replicas' work budgets are read at scrape time (callback
gauges), so the hot path pays nothing for them; counters and histograms are updated as things happen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tidegate.policy.ttft_model import TtftFit

__all__ = ["OverloadMetrics"]

_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
# time to first token against tier targets of seconds to minutes (the alert compares its P99 with 1.2x
# the target, so buckets lie close around the usual targets)
_TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.6, 4.0, 5.0, 6.0, 7.5, 10.0, 12.0, 15.0, 20.0,
                   30.0, 60.0, 120.0, 600.0)
# rejections must be answered in milliseconds: fine buckets there
_REJECTION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 1.0)


class OverloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.queue_depth = Gauge("tidegate_overload_queue_depth", "Requests waiting, by pool and tier",
                                 ["pool", "tier"], registry=r)
        self.oldest_wait = Gauge("tidegate_overload_queue_oldest_wait_seconds",
                                 "Wait so far of the oldest waiting request, by pool and tier", ["pool", "tier"],
                                 registry=r)
        self.queue_wait = Histogram("tidegate_overload_queue_wait_seconds",
                                    "Arrival to dispatch of dispatched requests, by pool and tier",
                                    ["pool", "tier"], buckets=_WAIT_BUCKETS_S, registry=r)
        self.predicted_wait = Histogram("tidegate_overload_predicted_wait_seconds",
                                        "Wait predicted at arrival for requests that queued and were later "
                                        "dispatched (compare with tidegate_overload_queue_wait_seconds, which also "
                                        "counts, with 0, those sent at arrival)", ["pool", "tier"],
                                        buckets=_WAIT_BUCKETS_S, registry=r)
        self.admissions = Counter("tidegate_overload_admissions", "Arrivals by outcome (queued, rate_limited, "
                                  "too_large, preset_reply, fallback_pool)", ["pool", "tier", "outcome"], registry=r)
        self.rejections = Counter("tidegate_overload_rejections", "Requests refused or shed, by reason",
                                  ["pool", "tier", "reason"], registry=r)
        self.degraded = Counter("tidegate_overload_degraded_responses", "Responses served below the primary "
                                "rung, by rung", ["pool", "rung"], registry=r)
        self.rejection_latency = Histogram("tidegate_overload_rejection_seconds",
                                           "Arrival to the answer of a request refused at admission",
                                           ["pool"], buckets=_REJECTION_BUCKETS_S, registry=r)
        self.ttft = Histogram("tidegate_overload_time_to_first_token_seconds", "Streamed requests: arrival to "
                              "their first token, by pool and tier", ["pool", "tier"], buckets=_TTFT_BUCKETS_S,
                              registry=r)
        self.first_tokens = Counter("tidegate_overload_first_tokens", "Streamed requests' first tokens, by "
                                    "whether they came within their tier's TTFT target (outcome: within_target, "
                                    "late): the latency SLO's events", ["pool", "tier", "outcome"], registry=r)
        self.ttft_target = Gauge("tidegate_tier_ttft_target_seconds", "Each tier's time-to-first-token target",
                                 ["tier"], registry=r)
        self.over_share = Gauge("tidegate_overload_tenants_over_share", "Tenants sending more than their fair "
                                "share's over_share_factor (their tier's other tenants are protected meanwhile)",
                                ["pool", "tier"], registry=r)
        self.work_budget = Gauge("tidegate_replica_work_budget_tokens", "Prefill tokens the replica's engine may "
                                 "hold ahead of a best-tier request: its fitted TTFT line at the engine's share of "
                                 "the target (NaN before its first token is measured)", ["pool", "replica"],
                                 registry=r)
        self.ttft_fit = Gauge("tidegate_replica_ttft_fit_seconds", "The replica's fitted engine time to first "
                              "token: `fixed` seconds plus `per_token` seconds for each prefill token ahead (NaN "
                              "before its first token)", ["pool", "replica", "coefficient"], registry=r)

    def of(self, metric: Any, *labels: str) -> Any:
        """The labelled child, resolved once: `labels()` takes a lock and builds a key each call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch_queue(self, pool: str, tier: str, depth: Callable[[], float], oldest_wait_s: Callable[[], float],
                    over_share: Callable[[], float] | None = None) -> None:
        self.queue_depth.labels(pool, tier).set_function(depth)
        self.oldest_wait.labels(pool, tier).set_function(oldest_wait_s)
        if over_share is not None:
            self.over_share.labels(pool, tier).set_function(over_share)

    def watch_work_budget(self, pool: str, replica: str, budget_tokens: Callable[[], float | None],
                          fit: Callable[[], TtftFit | None]) -> None:
        def read() -> float:
            tokens = budget_tokens()
            return math.nan if tokens is None else tokens

        def coefficient(name: str) -> Callable[[], float]:
            return lambda: math.nan if (line := fit()) is None else getattr(line, name)

        self.work_budget.labels(pool, replica).set_function(read)
        self.ttft_fit.labels(pool, replica, "fixed").set_function(coefficient("fixed_s"))
        self.ttft_fit.labels(pool, replica, "per_token").set_function(coefficient("s_per_token"))
